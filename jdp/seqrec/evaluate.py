"""Full-ranking evaluation: NDCG@10 / HIT@10 of the held-out next item among ALL items.

Scores are the model's logits at the last position of the (left-padded) history. The padding id 0
is never ranked. `mask_history=True` removes the items of the input history from the candidates
(the target itself is kept); the default (False) ranks every item, as Krichene & Rendle advocate
and the DPFormer paper does not state otherwise. Ties are counted pessimistically (rank = number of
items scoring >= the target, minus one). Users with target 0 (fewer than 3 items) are skipped.
Metrics are post-processing of the released model on held-out data and are not private.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.metrics import rank_of_target


def ndcg_hit_from_ranks(ranks: np.ndarray, k: int = 10) -> dict:
    """0-based ranks -> {"ndcg": mean 1[r<k]/log2(r+2), "hit": mean 1[r<k]} (fractions)."""
    ranks = np.asarray(ranks, np.float64)
    if ranks.size == 0:
        raise ValueError("ranks must be non-empty")
    hit = ranks < k
    return {"ndcg": float(np.mean(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0))), "hit": float(np.mean(hit))}


def evaluate(model: Any, params: Any, inputs: np.ndarray, targets: np.ndarray, k: int = 10,
             mask_history: bool = False, chunk: int = 1024, reatt: dict | None = None,
             rank_fn=None, length_buckets: tuple = ()) -> dict:
    """{"ndcg": ..., "hit": ..., "n_users": ...} over users with a target; scored in user chunks.

    reatt: Re-Attention variances for DPFormer (the correction is part of the model).
    length_buckets: shorter windows for users with short histories (same scores, less compute). Every
    call is padded to `chunk` users or, for a smaller bucket, to the next power of two, so evaluations of
    different user sets (validation, test) reuse the same few compiled shapes. A `rank_fn` made with
    `both_protocols=True` adds "other": the metrics under the other history protocol."""
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    if inputs.ndim != 2 or targets.shape != (inputs.shape[0],):
        raise ValueError("inputs must be [U, L] and targets [U]")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    keep = np.flatnonzero(targets > 0)
    if keep.size == 0:
        raise ValueError("no users with a target")
    if rank_fn is None:
        rank_fn = make_rank_fn_reatt(model, mask_history, reatt)
    L = inputs.shape[1]
    out = []
    for idx, idx_p, Lb in _calls(inputs, keep, chunk, length_buckets):
        r = np.asarray(rank_fn(params, jnp.asarray(inputs[idx_p, L - Lb:]), jnp.asarray(targets[idx_p])))
        out.append(r[:idx.size])
    ranks = np.concatenate(out)
    if ranks.ndim == 2:  # both protocols: this evaluation's first, the other second
        return {**ndcg_hit_from_ranks(ranks[:, 0], k), "n_users": int(keep.size),
                "other": ndcg_hit_from_ranks(ranks[:, 1], k)}
    return {**ndcg_hit_from_ranks(ranks, k), "n_users": int(keep.size)}


def _calls(inputs: np.ndarray, keep: np.ndarray, chunk: int, length_buckets: tuple):
    """`evaluate`'s calls on the users `keep`: (users, users padded to the call's static size, window) per call."""
    L = inputs.shape[1]
    buckets = np.array(sorted({int(b) for b in length_buckets if 0 < b < L} | {L}))
    bid = np.searchsorted(buckets, (inputs[keep] > 0).sum(1))
    for bi, Lb in enumerate(buckets):
        users = keep[bid == bi]
        for s in range(0, users.size, chunk):
            idx = users[s:s + chunk]
            pad = min(chunk, 1 << (idx.size - 1).bit_length()) - idx.size  # few static shapes
            yield idx, (np.concatenate([idx, np.repeat(idx[:1], pad)]) if pad else idx), int(Lb)


def evaluation_shapes(inputs: list, targets: list, chunk: int = 1024, length_buckets: tuple = ()) -> list:
    """The distinct (inputs, targets) argument shapes (as jax.ShapeDtypeStructs) of the `rank_fn` calls that
    `evaluate` makes on each of the user sets `inputs[i]`, `targets[i]`: for compiling them ahead."""
    shapes = {}
    for x, t in zip(inputs, targets):
        x, t = np.asarray(x), np.asarray(t)
        keep = np.flatnonzero(t > 0)
        if keep.size == 0:
            continue
        dx, dt = jnp.asarray(x[:1]).dtype, jnp.asarray(t[:1]).dtype
        for _, idx_p, Lb in _calls(x, keep, chunk, length_buckets):
            shapes[(idx_p.size, Lb)] = (jax.ShapeDtypeStruct((idx_p.size, Lb), dx),
                                        jax.ShapeDtypeStruct((idx_p.size,), dt))
    return list(shapes.values())


def own_history_ranks(inputs: np.ndarray, targets: np.ndarray, n_items: int) -> np.ndarray:
    """0-based ranks of the targets under the ZERO-COST ranking: the user's own distinct items, most recent
    first, then every other item tied (pessimistic: a target outside the history ranks last, n_items − 1).
    Each user computes it from their own history alone; nothing is released."""
    ranks = np.full(targets.shape[0], n_items - 1, np.int64)
    for u, (row, t) in enumerate(zip(np.asarray(inputs), np.asarray(targets))):
        recent = row[row > 0][::-1]
        if t in recent:
            items, first = np.unique(recent, return_index=True)  # each item's most recent position
            ranks[u] = int(np.sum(first < first[np.searchsorted(items, t)]))
    return ranks


def popularity_ranks(targets: np.ndarray, item_scores: np.ndarray) -> np.ndarray:
    """0-based ranks of the targets when every user gets the items ordered by `item_scores` [n_items + 1]
    (index 0 = padding, never ranked), ties pessimistic: a popularity recommender built from released or
    public counts only."""
    scores = np.asarray(item_scores, np.float64)[1:]
    order = np.sort(scores)
    t = scores[np.asarray(targets) - 1]
    return scores.size - np.searchsorted(order, t, side="left") - 1


def baseline_metrics(data: Any, item_scores: np.ndarray | None = None, k: int = 10,
                     splits: tuple[str, ...] = ("valid", "test")) -> dict:
    """NDCG@k / HIT@k on the `splits` targets of `data` (a SeqData) of what users get without the model:
    "zero_cost" (`own_history_ranks`) and, given public or already released item counts, "popularity"
    (`popularity_ranks`, post-processing of that release: no further privacy cost)."""
    if not set(splits) <= {"valid", "test"}:
        raise ValueError(f"splits must be among ('valid', 'test'), got {splits!r}")
    out = {}
    for split in splits:
        inputs, targets = getattr(data, f"{split}_input"), getattr(data, f"{split}_target")
        keep = np.flatnonzero(np.asarray(targets) > 0)
        rankings = {"zero_cost": own_history_ranks(inputs[keep], targets[keep], data.n_items)}
        if item_scores is not None:
            rankings["popularity"] = popularity_ranks(targets[keep], item_scores)
        for name, ranks in rankings.items():
            m = ndcg_hit_from_ranks(ranks, k)
            out.setdefault(name, {}).update({f"ndcg_at_{k}_{split}": m["ndcg"], f"hit_at_{k}_{split}": m["hit"]})
    return out


def make_rank_fn_reatt(model: Any, mask_history: bool = False, reatt: dict | None = None,
                       both_protocols: bool = False):
    """ranks(params, inputs [b, L], targets [b]) -> 0-based rank of each target among all items. The
    Re-Attention variances are an input of the compiled program, not constants in it: a new release
    (new seed or ε) reuses the compilation. `both_protocols`: ranks [b, 2], under `mask_history` and
    under the other protocol, from one forward pass (one compilation serves both)."""
    @jax.jit
    def ranks_of(params, inputs, targets, reatt):
        scores = model.apply(params, inputs, deterministic=True, reatt=reatt, last_only=True)[:, -1]
        scores = scores.at[:, 0].set(-jnp.inf)

        def ranks(masked):
            if not masked:
                return rank_of_target(scores, targets, None)
            b = inputs.shape[0]
            exclude = jnp.zeros(scores.shape, bool).at[jnp.arange(b)[:, None], inputs].set(True)
            return rank_of_target(scores, targets, exclude.at[:, 0].set(False))
        if both_protocols:
            return jnp.stack([ranks(mask_history), ranks(not mask_history)], axis=1)
        return ranks(mask_history)
    return functools.partial(ranks_of, reatt=reatt)


__all__ = ["baseline_metrics", "evaluate", "evaluation_shapes", "make_rank_fn_reatt", "ndcg_hit_from_ranks", "own_history_ranks",
           "popularity_ranks"]
