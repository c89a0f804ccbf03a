"""NON-PRIVATE diagnostic: how far each item row of a trained seqrec model moved from its random start, by
popularity band (Amazon Games; issue: "the popular rows stay 0.8-correlated with their random start").

    PYTHONPATH=. python -m benchmarks.seqrec.row_drift NAME=RUN.ckpt [NAME=RUN.ckpt ...] [--seed 0]
        [--model dpformer] [--data-dir DIR]

Each RUN.ckpt is the final checkpoint of `jdp seqrec --checkpoint RUN.ckpt --seed S` with the default
architecture and a random start (`--item-init random`): the initial table is rebuilt from the seed as `train.train`
does (key(S) split into initialisation, histogram and training keys). Per band of items ranked by their exact
training-target counts (a diagnostic, never a release): the mean distance a row moved, the mean cosine between its
final and initial rows, and the fraction of rows that never moved (DP-FEST leaves unselected rows exactly where
they were). Writes benchmarks/seqrec/results/seqrec_row_drift.json.
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_results
from benchmarks.seqrec.table_diagnostics import BANDS, load_params, table
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import models, train


def initial_table(model_name: str, data, seed: int) -> np.ndarray:
    cfg = train.TrainConfig(model=model_name)
    model = models.make_model(model_name, data.n_items, data.maxlen, cfg.d, cfg.heads, cfg.blocks, cfg.dropout_rate(False),
                              cfg.activation, cfg.norm, cfg.ffn_dim, cfg.item_dim)
    k_init = jax.random.split(jax.random.key(seed), 3)[0]
    return np.asarray(table(jax.jit(model.init)(k_init, jnp.zeros((1, data.maxlen), jnp.int32))))


def drift(init: np.ndarray, final: np.ndarray, order: np.ndarray, counts: np.ndarray) -> list[dict]:
    moved = final - init
    out = []
    for lo, hi in BANDS:
        r = order[lo:hi]
        dist = np.linalg.norm(moved[r], axis=1)
        cos = np.sum(final[r] * init[r], axis=1) / np.maximum(
            np.linalg.norm(final[r], axis=1) * np.linalg.norm(init[r], axis=1), 1e-12)
        out.append({"popularity_ranks": [lo, lo + len(r)], "count_range": [int(counts[r].min()), int(counts[r].max())],
                    "moved": float(dist.mean()), "cosine_with_start": float(cos.mean()),
                    "never_moved": float(np.mean(dist == 0.0))})
        print(f"  ranks {lo}-{lo + len(r)} (counts {counts[r].min()}-{counts[r].max()}): moved {dist.mean():.3f}, "
              f"cosine with start {cos.mean():.3f}, never moved {np.mean(dist == 0.0):.1%}", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", metavar="NAME=CKPT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="dpformer")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    data = D.load("amazon-games", path=fetch("amazon-games", args.data_dir))
    init = initial_table(args.model, data, args.seed)
    counts = np.bincount(np.asarray(data.train_target).ravel(), minlength=data.n_items + 1)
    counts[0] = 0
    order = np.argsort(-counts[1:], kind="stable") + 1  # item ids by popularity (id 0: padding)
    result = {"initial_row_norm": float(np.linalg.norm(init[1:], axis=1).mean()), "runs": {}}
    for spec in args.runs:
        name, path = spec.split("=", 1)
        print(name, flush=True)
        final = np.asarray(table(load_params(path)))
        result["runs"][name] = {"checkpoint": pathlib.PurePath(path).name, "bands": drift(init, final, order, counts)}
    command = " ".join(["python -m benchmarks.seqrec.row_drift"]
                       + [f"{s.split('=', 1)[0]}=<{pathlib.PurePath(s.split('=', 1)[1]).name}>" for s in args.runs]
                       + ["--seed", str(args.seed), "--model", args.model]
                       + (["--data-dir", "<datasets>"] if args.data_dir else []))
    path = write_results("seqrec_row_drift", [result], command, nonprivate_diagnostic=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
