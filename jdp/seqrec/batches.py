"""What one training step reads: its Poisson sample laid out in physical chunks by sequence length
(`length_chunks`, `step_batches`) and the sampled softmax's negatives (`negative_probs`, `sample_negatives`).

Speed: each chunk holds users of similar length in the shortest window that fits them, about `chunk_rows`
positions per chunk, so the full-softmax output layer (most of the FLOPs) is computed at few padding positions.
Padding never changes an output (masked attention, right-anchored positions, masked rows).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdp import accounting
from jdp.seqrec.config import TrainConfig
from jdp.seqrec.data import SeqData, item_presence


def check_negatives(cfg: TrainConfig, n_items: int, counts_available: bool) -> None:
    """Errors of a sampled-softmax config on a catalogue of n_items (before any work is done)."""
    if cfg.negatives >= n_items:
        raise ValueError(f"negatives must be < the number of items ({n_items}), got {cfg.negatives}")
    if cfg.negative_sampler == "popularity" and cfg.epsilon is not None and not counts_available:
        raise ValueError("popularity negatives in a private run need public_item_counts (declared public) "
                         "or model 'dpformer' (whose released item histogram is then used)")


def negative_probs(data: SeqData, cfg: TrainConfig, counts: np.ndarray | None, public: bool,
                   report: accounting.PrivacyReport | None) -> np.ndarray | None:
    """Sampling distribution [M] over items 1..M of the sampled softmax's negatives (None = uniform), and
    the statement of why it costs no privacy, recorded in the report.

    The K negatives of a step are drawn once from this distribution, independently of the private data
    and shared by every user of the step: given them, each user's clipped gradient depends on that user's
    sequence alone, so the step's sensitivity stays C and nothing new is released. "popularity" uses
    counts that are already public or released: the caller's declared public counts, else DPFormer's
    Gaussian histogram (post-processing); a NON-PRIVATE run uses the exact counts. Add-one smoothing
    keeps every item reachable."""
    K, M = int(cfg.negatives), data.n_items
    check_negatives(cfg, M, counts is not None)
    if cfg.negative_sampler == "uniform":
        probs, source = None, "uniformly from the catalogue"
        counts = None
    else:
        if cfg.epsilon is None:
            counts, source = item_presence(data.train_input, data.train_target, M), "the exact counts (non-private)"
        else:
            source = ("the caller-declared public item counts" if public else
                      "DPFormer's released item histogram (post-processing)")
        if np.shape(counts) != (M + 1,) or not np.isfinite(counts).all():
            raise ValueError(f"item counts for popularity negatives must be finite, of shape ({M + 1},)")
        source = "in proportion to " + source + " (+1)"
        w = np.maximum(np.asarray(counts, np.float64)[1:], 0.0) + 1.0
        probs = w / w.sum()
    if report is not None:
        report.assume(f"sampled softmax: {K} distinct negatives per step drawn {source}, independent of the "
                      "private data given the releases and shared by every user of the step (sensitivity "
                      "unchanged, no extra release)")
    return probs


def sample_negatives(key: jax.Array, n_items: int, k: int, probs: np.ndarray | None) -> np.ndarray:
    """k distinct items in 1..n_items, uniform or with probabilities `probs` [n_items] (Gumbel top-k)."""
    if probs is None:
        return np.asarray(jax.random.choice(key, n_items, (k,), replace=False)) + 1
    g = np.asarray(jax.random.gumbel(key, (n_items,))) + np.log(probs)
    return np.argpartition(-g, k - 1)[:k] + 1


def length_chunks(lengths: np.ndarray, windows: np.ndarray, rows: int) -> list[tuple[int, np.ndarray, int]]:
    """Lays out one sample's users as physical chunks: [(window, positions into `lengths` [P], n_real)].

    Longest users first; a chunk takes the next rows // window users, window = the smallest of `windows`
    (sorted, last = maxlen) that fits the chunk's longest user. Every chunk is full except the last (the
    shortest users), which is padded (repeating its first entry, masked by the caller) to a power of two,
    so a run compiles few shapes; a step that fits in ONE chunk is padded to the full chunk (one shape for
    the whole run: `chunk_rows` ≥ the largest sample × maxlen makes every step a single compiled call).
    Every user is in exactly one chunk."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    out, i = [], 0
    while i < order.size:
        w = int(windows[min(np.searchsorted(windows, lengths[order[i]]), windows.size - 1)])
        full = max(1, rows // w)
        part = order[i:i + full]
        only = i == 0 and part.size == order.size  # the whole step in one chunk
        size = full if part.size == full or only else min(full, 1 << int(np.ceil(np.log2(part.size))))
        out.append((w, np.concatenate([part, np.repeat(part[:1], size - part.size)]), part.size))
        i += part.size
    return out


def step_batches(data: SeqData, idx: np.ndarray, windows: np.ndarray, rows: int, key: jax.Array,
                 negatives: jax.Array | None = None) -> list[tuple[int, dict, jax.Array]]:
    """One step's sampled users `idx` as engine batches [(window, batch, mask)] laid out by `length_chunks`.

    Randomness per user: a dropout key per row (independent draws, whatever the layout). The step's
    `negatives` (sampled softmax) are the same array in every chunk: drawing them per chunk would tie
    a user's gradient to who else shares the chunk, and adding one user moves others between chunks."""
    L = data.maxlen
    out = []
    for c, (w, pos, n_real) in enumerate(length_chunks((data.train_input[idx] > 0).sum(1), windows, rows)):
        users = idx[pos]
        batch = {"input": jnp.asarray(data.train_input[users, L - w:]),
                 "target": jnp.asarray(data.train_target[users, L - w:]),
                 "key": jax.random.split(jax.random.fold_in(key, c), pos.size)}
        if negatives is not None:  # one copy per row (the engine's per-example layout)
            batch["negatives"] = jnp.broadcast_to(negatives, (pos.size, negatives.size))
        out.append((w, batch, jnp.asarray(np.arange(pos.size) < n_real)))
    return out


__all__ = ["check_negatives", "length_chunks", "negative_probs", "sample_negatives", "step_batches"]
