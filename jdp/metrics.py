"""Evaluation metrics: RMSE / MAE, ranking metrics (Recall/NDCG/HIT@k) and popularity-sliced variants.

Metrics are post-processing of released models; they read held-out data and are not private
(reporting them is the experimenter's concern, not the mechanism's).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _errors(pred, target, mask) -> np.ndarray:
    pred, target = np.asarray(pred, np.float64), np.asarray(target, np.float64)
    if pred.shape != target.shape:
        raise ValueError(f"pred and target must have the same shape, got {pred.shape} and {target.shape}")
    err = pred - target
    if mask is None:
        return err.ravel()
    mask = np.asarray(mask)
    if mask.shape != err.shape:
        raise ValueError(f"mask must have the shape of pred {err.shape}, got {mask.shape}")
    return err[mask.astype(bool)]


def rmse(pred: np.ndarray, target: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Root mean squared error over the entries where mask is true (all when mask is None), in float64
    on the host; NaN when there are none."""
    err = _errors(pred, target, mask)
    return float(np.sqrt(np.mean(err**2))) if err.size else math.nan


def mae(pred: np.ndarray, target: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean absolute error over the entries where mask is true (all when mask is None), in float64 on the
    host; NaN when there are none."""
    err = _errors(pred, target, mask)
    return float(np.mean(np.abs(err))) if err.size else math.nan


def top_k(scores: jax.Array, k: int, exclude: jax.Array | None = None) -> jax.Array:
    """Indices [users, k] of the k highest scores per row; `exclude` (bool [users, items]) removed."""
    if exclude is not None:
        scores = jnp.where(exclude, -jnp.inf, scores)
    return jax.lax.top_k(scores, k)[1]


def _hits(scores, targets, k, exclude):
    # top_k ranks NaN first: a NaN-scored target is no hit (it still takes its slot from the other items)
    idx = top_k(scores, k, exclude)
    hit = jnp.take_along_axis(targets, idx, axis=1) & ~jnp.isnan(jnp.take_along_axis(scores, idx, axis=1))
    return hit.astype(jnp.float32)  # [users, k]


def recall_at_k(scores: jax.Array, targets: jax.Array, k: int, exclude: jax.Array | None = None) -> jax.Array:
    """Per-user Recall@k = |top-k ∩ targets| / min(k, |targets|); NaN for users without targets.

    scores: [users, items]; targets: bool [users, items]; exclude: bool [users, items] (history).
    """
    hits = _hits(scores, targets, k, exclude).sum(1)
    n = targets.sum(1).astype(jnp.float32)
    return jnp.where(n > 0, hits / jnp.minimum(float(k), jnp.maximum(n, 1.0)), jnp.nan)


def ndcg_at_k(scores: jax.Array, targets: jax.Array, k: int, exclude: jax.Array | None = None) -> jax.Array:
    """Per-user NDCG@k with binary relevance; ideal DCG over min(k, |targets|) hits; NaN if no targets."""
    hits = _hits(scores, targets, k, exclude)
    discounts = 1.0 / jnp.log2(jnp.arange(2, k + 2, dtype=jnp.float32))
    dcg = (hits * discounts).sum(1)
    n = jnp.minimum(targets.sum(1), k)
    idcg = jnp.cumsum(discounts)[jnp.maximum(n - 1, 0)]
    return jnp.where(n > 0, dcg / idcg, jnp.nan)


def hit_at_k(scores: jax.Array, targets: jax.Array, k: int, exclude: jax.Array | None = None) -> jax.Array:
    """Per-user HIT@k: 1 if any target is in the top k; NaN if no targets."""
    hits = _hits(scores, targets, k, exclude).max(1)
    return jnp.where(targets.sum(1) > 0, hits, jnp.nan)


def rank_of_target(scores: jax.Array, target: jax.Array, exclude: jax.Array | None = None) -> jax.Array:
    """0-based rank of one target item per row among all items (ties counted pessimistically).

    scores: [users, items]; target: int [users]. Used for full-ranking NDCG/HIT with one target:
    NDCG@k = 1/log2(rank+2) if rank < k, HIT@k = rank < k. A NaN score counts against the target: a NaN
    target ranks last, and any other NaN item ranks above it (a broken model never scores a hit).
    """
    if exclude is not None:
        exclude = exclude.at[jnp.arange(scores.shape[0]), target].set(False)
        scores = jnp.where(exclude, -jnp.inf, scores)
    t = jnp.take_along_axis(scores, target[:, None], axis=1)
    above = (scores >= t) | jnp.isnan(scores) | jnp.isnan(t)
    return jnp.sum(above, axis=1) - 1


def popularity_buckets(counts: np.ndarray, n_buckets: int = 5) -> np.ndarray:
    """Bucket id per item: items sorted by count ascending, split into equal-size buckets (0 = tail)."""
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError("counts must be a non-empty 1-d array")
    if n_buckets < 1 or n_buckets > counts.size:
        raise ValueError(f"n_buckets must be in [1, {counts.size}], got {n_buckets}")
    order = np.argsort(counts, kind="stable")
    bucket = np.empty(counts.size, dtype=np.int32)
    bucket[order] = np.arange(counts.size) * n_buckets // counts.size
    return bucket


def sliced_rmse(pred: np.ndarray, target: np.ndarray, item: np.ndarray, bucket_of_item: np.ndarray,
                n_buckets: int | None = None) -> list[float]:
    """RMSE of the ratings whose item falls in each popularity bucket (NaN for an empty bucket)."""
    n_buckets = int(bucket_of_item.max()) + 1 if n_buckets is None else n_buckets
    b = np.asarray(bucket_of_item)[np.asarray(item)]
    err = (np.asarray(pred, np.float64) - np.asarray(target, np.float64)) ** 2
    sums = np.bincount(b, weights=err, minlength=n_buckets)
    cnts = np.bincount(b, minlength=n_buckets)
    with np.errstate(invalid="ignore", divide="ignore"):
        return [float(x) for x in np.sqrt(sums / cnts)]


def sliced_recall(scores: jax.Array, targets: jax.Array, bucket_of_item: np.ndarray,
                  ks: tuple[int, ...] = (20, 40, 60, 80, 100), exclude: jax.Array | None = None) -> list[float]:
    """Recall within each popularity bucket: candidates and targets restricted to the bucket's items,
    k = ks[b] for bucket b (the paper's footnote uses 20..100 for buckets 0..4). Mean over users with
    targets in the bucket."""
    out = []
    bucket_of_item = np.asarray(bucket_of_item)
    for b, k in enumerate(ks):
        items = np.flatnonzero(bucket_of_item == b)
        if items.size == 0:
            out.append(float("nan"))
            continue
        kk = min(k, items.size)
        s, t = scores[:, items], targets[:, items]
        ex = None if exclude is None else exclude[:, items]
        out.append(float(jnp.nanmean(recall_at_k(s, t, kk, ex))))
    return out


__all__ = ["hit_at_k", "mae", "ndcg_at_k", "popularity_buckets", "rank_of_target", "recall_at_k", "rmse",
           "sliced_recall", "sliced_rmse", "top_k"]
