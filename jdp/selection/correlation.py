"""Correlation of scores with sensitivities: Spearman, Pearson and the bucket-weighted measure.

The sign of the correlation tells which heterogeneous mechanism fits: positive (the good candidates are
the sensitive ones) favours mGEM / RS_γ, negative favours GEM, none favours plain RNM. These statistics
read the private scores: they are NON-PRIVATE diagnostics (use them on public or proxy data, or let
`combined_gem` make the choice privately with randomized response).
All functions take [..., k] arrays and reduce the last axis (jit/vmap friendly).
"""
from __future__ import annotations

import concurrent.futures
import os

import jax
import jax.numpy as jnp
import jax.scipy.stats as jstats
import numpy as np


def _weighted_pearson(x: jax.Array, y: jax.Array, w: jax.Array) -> jax.Array:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    xc = x - jnp.sum(w * x, axis=-1, keepdims=True)
    yc = y - jnp.sum(w * y, axis=-1, keepdims=True)
    cov = jnp.sum(w * xc * yc, axis=-1)
    var = jnp.sum(w * xc * xc, axis=-1) * jnp.sum(w * yc * yc, axis=-1)
    # constant vectors have no correlation: return 0 instead of NaN
    return jnp.where(var > 0, cov / jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)


def pearson(x: jax.Array, y: jax.Array) -> jax.Array:
    """Pearson correlation along the last axis; 0 for constant inputs."""
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    return _weighted_pearson(x, y, jnp.ones_like(x))


def _ranks(x: jax.Array) -> jax.Array:
    """Average ranks (1-based) along the last axis; pairwise counts for k ≤ 16 (O(k²) memory), else sorting."""
    x = jnp.asarray(x, jnp.float32)
    if x.shape[-1] <= 16:
        less = jnp.sum(x[..., None, :] < x[..., :, None], axis=-1, dtype=jnp.float32)
        equal = jnp.sum(x[..., None, :] == x[..., :, None], axis=-1, dtype=jnp.float32)
        return less + (equal + 1.0) / 2.0
    rank = lambda v: jstats.rankdata(v, method="average")
    for _ in range(x.ndim - 1):
        rank = jax.vmap(rank)
    return rank(x).astype(jnp.float32)


def spearman(x: jax.Array, y: jax.Array) -> jax.Array:
    """Spearman rank correlation (average ranks for ties) along the last axis."""
    return pearson(_ranks(x), _ranks(jnp.broadcast_to(y, jnp.shape(x))))


def spearman_positive(x: jax.Array, y: jax.Array) -> jax.Array:
    """1[Spearman ρ(x, y) > 0] along the last axis, from the integer numerator
    Σ_a (2r_x(a) − k − 1)(2r_y(a) − k − 1) of ρ (average ranks; exact in float32 for k ≲ 250).
    Combined GEM privatises this bit; `spearman_positive_np` is the same statistic in NumPy."""
    k = jnp.shape(x)[-1]
    cx = 2.0 * _ranks(x) - (k + 1)
    cy = 2.0 * _ranks(jnp.broadcast_to(jnp.asarray(y, jnp.float32), jnp.shape(x))) - (k + 1)
    return jnp.sum(cx * cy, axis=-1) > 0


def _centred_ranks_np(x: np.ndarray) -> np.ndarray:
    """2·(average rank) − (k + 1) along the last axis, int64 (NumPy's sort is far faster than XLA:CPU's)."""
    k = x.shape[-1]
    order = np.argsort(x, axis=-1)
    xs = np.sort(x, axis=-1)  # = x in `order` (values), and cheaper than a gather
    pos = np.arange(k)
    diff = xs[..., 1:] != xs[..., :-1]
    if diff.all():
        twice = np.broadcast_to(2 * pos - (k - 1), x.shape)
    else:  # ties: every member of a run of equal values gets the run's mean position
        edge = np.ones(x.shape[:-1] + (1,), bool)
        start = np.maximum.accumulate(np.where(np.concatenate([edge, diff], -1), pos, 0), axis=-1)
        end = np.minimum.accumulate(np.where(np.concatenate([diff, edge], -1), pos, k)[..., ::-1], axis=-1)[..., ::-1]
        twice = start + end - (k - 1)
    out = np.empty(x.shape, np.int64)
    np.put_along_axis(out, order, twice, -1)
    return out


_ROWS_PER_CHUNK = 1024  # cache-sized blocks of rows; NumPy's sort releases the GIL, so blocks run in threads
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def spearman_positive_np(x, y) -> np.ndarray:
    """NumPy twin of `spearman_positive` (values ranked as float32, as the samplers see them)."""
    global _pool
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    if y.ndim == 1 and x.ndim > 1:  # one sensitivity vector for every row: rank it once
        return np.einsum("...k,k->...", _centred_ranks_np(x), _centred_ranks_np(y)) > 0
    y = np.broadcast_to(y, x.shape)
    if x.ndim != 2 or x.shape[0] <= _ROWS_PER_CHUNK:
        return np.einsum("...k,...k->...", _centred_ranks_np(x), _centred_ranks_np(y)) > 0
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    starts = range(0, x.shape[0], _ROWS_PER_CHUNK)
    blocks = _pool.map(lambda i: spearman_positive_np(x[i:i + _ROWS_PER_CHUNK], y[i:i + _ROWS_PER_CHUNK]), starts)
    return np.concatenate(list(blocks))


def bucket_weights(scores: jax.Array, sensitivities: jax.Array, buckets: int = 10) -> jax.Array:
    """Weight of each candidate = Δ_a / max Δ in its score bucket (equal-width buckets of the score range)."""
    q = jnp.asarray(scores, jnp.float32)
    d = jnp.broadcast_to(jnp.asarray(sensitivities, jnp.float32), q.shape)
    lo, hi = q.min(-1, keepdims=True), q.max(-1, keepdims=True)
    width = jnp.where(hi > lo, hi - lo, 1.0)
    bucket = jnp.clip(jnp.floor((q - lo) / width * buckets), 0, buckets - 1).astype(jnp.int32)
    onehot = jax.nn.one_hot(bucket, buckets, dtype=q.dtype)  # [..., k, buckets]
    bmax = jnp.max(jnp.where(onehot > 0, d[..., None], 0.0), axis=-2)  # [..., buckets]
    return d / jnp.take_along_axis(bmax, bucket, axis=-1)


def weighted_correlation(scores: jax.Array, sensitivities: jax.Array, buckets: int = 10) -> jax.Array:
    """The bucket-weighted correlation: weighted Pearson of (q, Δ) with the `bucket_weights`.

    The paper's exact weighting was not recoverable; this follows its appendix description (split the
    score range into `buckets` buckets, weight by Δ_a / max Δ within the bucket). Default buckets=10.
    """
    q = jnp.asarray(scores, jnp.float32)
    d = jnp.broadcast_to(jnp.asarray(sensitivities, jnp.float32), q.shape)
    return _weighted_pearson(q, d, bucket_weights(q, d, buckets))


def recommend_mechanism_nonprivate(scores, sensitivities, threshold: float = 0.2, buckets: int = 10) -> dict:
    """NON-PRIVATE helper: suggests a mechanism from the correlations of (scores, sensitivities).

    Returns {"mechanism", "spearman", "pearson", "weighted"}: "mgem" when the weighted correlation is
    above `threshold`, "gem" when below −threshold, otherwise "rnm-exp". It reads the scores, so apply
    it to public or proxy data (e.g. a previous period), or use `combined_gem` to choose privately.
    """
    w = float(weighted_correlation(scores, sensitivities, buckets))
    rho_s = float(spearman(scores, sensitivities))
    rho_p = float(pearson(scores, sensitivities))
    if w > threshold:
        name = "mgem"
    elif w < -threshold:
        name = "gem"
    else:
        name = "rnm-exp"
    return {"mechanism": name, "spearman": rho_s, "pearson": rho_p, "weighted": w}
