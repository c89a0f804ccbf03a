"""Checkpoints of a `jdp.seqrec.train` run: the run record a checkpoint must match to be resumed (`run_record`,
`check_resumable`) and the files written beside it (`write_checkpoint`) and read back (`resume`)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from jdp.clipping.dp_sgd import with_noise_key, without_noise_key
from jdp.seqrec.config import TrainConfig
from jdp.seqrec.data import SeqData

# TrainConfig fields that change neither a release nor its accounting (evaluation, memory and speed only): a
# resumed run may change them
RESUMABLE_FIELDS = ("eval_every_epochs", "eval_chunk", "mask_history", "batch_chunk", "chunk_rows")


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def run_record(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None) -> dict:
    """What a checkpoint must have been trained with to be resumed: the config (but `RESUMABLE_FIELDS`), digests
    of the key, the training data and the declared public counts. The key's randomness makes the releases (the
    histogram, the item start, every step's noise), so resuming under another key, budget or dataset would
    compose releases that the report does not count, or reuse one noise draw on other data."""
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_FIELDS}
    key_bits = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    counts = None if public_item_counts is None else _digest(np.asarray(public_item_counts, np.float64))
    return json.loads(json.dumps({"config": config, "key": _digest(np.asarray(key_bits)),
                                  "train_data": _digest(data.train_input, data.train_target, np.int64(data.n_items)),
                                  "public_item_counts": counts},
                                 default=lambda v: v.item() if hasattr(v, "item") else repr(v)))


def _record_file(ckpt: pathlib.Path) -> pathlib.Path:
    return ckpt.with_name(ckpt.name + ".run.json")


def _history_file(ckpt: pathlib.Path) -> pathlib.Path:
    return ckpt.with_name(ckpt.name + ".history.json")


def check_resumable(ckpt: pathlib.Path, record: dict) -> None:
    """Raises ValueError unless the checkpoint's run record equals `record` (`run_record`)."""
    path = _record_file(ckpt)
    if not path.exists():
        raise ValueError(f"{ckpt} has no run record ({path.name}): it was written by an older jdp or moved without "
                         "it, so jdp cannot check that resuming it continues the same run; start a new checkpoint")
    saved = json.loads(path.read_text())
    differ = [f"config.{k}" for k in sorted(set(saved.get("config", {})) | set(record["config"]))
              if saved.get("config", {}).get(k) != record["config"].get(k)]
    differ += [k for k in ("key", "train_data", "public_item_counts") if saved.get(k) != record[k]]
    if differ:
        raise ValueError(f"{ckpt} was written by another run (different {', '.join(differ)}): resuming it would "
                         "compose releases that the privacy report does not count. Resume with the same data, "
                         "config and seed, or start a new checkpoint")


def write_checkpoint(ckpt: pathlib.Path, state, history: list, record: dict) -> None:
    """Writes the state without its noise key (`without_noise_key`: the key predicts every later step's noise), the
    history and the run record beside it."""
    ckpt.write_bytes(flax.serialization.to_bytes(without_noise_key(state)))
    _history_file(ckpt).write_text(json.dumps(history))
    _record_file(ckpt).write_text(json.dumps(record))


def resume(ckpt: pathlib.Path, state, noise_key) -> tuple[Any, int, list]:
    """(state, steps done, history) of the checkpoint, its state read into `state`'s structure. The file holds no
    noise key (`without_noise_key`): a private run's follows from the run's key (`noise_key`; None: the
    NON-PRIVATE reference, which has none)."""
    state = flax.serialization.from_bytes(state, ckpt.read_bytes())
    if noise_key is not None:
        state = with_noise_key(state, noise_key)
    start = int(state.step)
    hist_file = _history_file(ckpt)
    history = []
    if hist_file.exists():
        history = [h for h in json.loads(hist_file.read_text()) if h["step"] <= start]
    return state, start, history


__all__ = ["RESUMABLE_FIELDS", "check_resumable", "resume", "run_record", "write_checkpoint"]
