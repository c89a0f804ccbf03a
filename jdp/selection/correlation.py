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
import threading

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


class _Buffers(threading.local):
    """Per-thread scratch arrays for `_spearman_numerator_np` (reused: fresh temporaries per block
    cost more than the sorts and serialise the threads)."""
    shape = None

    def get(self, shape):
        if self.shape != shape:
            self.shape = shape
            self.bits, self.tmp = np.empty(shape, np.int32), np.empty(shape, np.int32)
            self.a, self.b, self.high = (np.empty(shape, np.uint64) for _ in range(3))
        return self


_buffers = _Buffers()
_LOW, _32 = np.uint64(0xFFFFFFFF), np.uint64(32)


def _order_keys_into(x: np.ndarray, buf: _Buffers, out: np.ndarray) -> None:
    """out[...] = uint32 keys in the order of the float32 values x (−0 and +0 get the same key)."""
    bits, tmp = buf.bits, buf.tmp
    np.add(x, np.float32(0), out=bits.view(np.float32))  # + 0 maps −0 to +0
    np.right_shift(bits, 31, out=tmp)  # order-preserving float -> signed int -> unsigned int map
    np.bitwise_and(tmp, 0x7FFFFFFF, out=tmp)
    np.bitwise_xor(bits, tmp, out=bits)
    np.bitwise_xor(bits.view(np.uint32), np.uint32(0x80000000), out=bits.view(np.uint32))
    out[...] = bits.view(np.uint32)


def _centred_sorted_np(keys: np.ndarray, buf: _Buffers) -> np.ndarray:
    """2·(average rank) − (k + 1) at each position of rows of sorted uint64 keys whose high words
    hold the ranked values (ties: equal high words share the mean position of their run)."""
    k = keys.shape[-1]
    pos = np.arange(k)
    high = np.right_shift(keys, _32, out=buf.high)
    diff = high[..., 1:] != high[..., :-1]
    if diff.all():
        return 2 * pos - (k - 1)
    edge = np.ones(keys.shape[:-1] + (1,), bool)
    start = np.maximum.accumulate(np.where(np.concatenate([edge, diff], -1), pos, 0), axis=-1)
    end = np.minimum.accumulate(np.where(np.concatenate([diff, edge], -1), pos, k)[..., ::-1], axis=-1)[..., ::-1]
    return start + end - (k - 1)


def _spearman_numerator_np(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Σ_a (2r_x(a) − k − 1)(2r_y(a) − k − 1) for float32 rows [R, k], int64 [R].

    Two integer sorts of (value key | payload) per row and no gathers (NumPy's vectorised integer sort
    is ~3x faster than its argsort): sort by x carrying y -> x's centred ranks beside their y; sort by
    y carrying those ranks -> y's centred ranks beside the x ranks of the same candidates.
    """
    k = x.shape[-1]
    buf = _buffers.get(x.shape)
    a, b = buf.a, buf.b
    _order_keys_into(x, buf, a)
    a <<= _32
    _order_keys_into(y, buf, b)
    a |= b
    a.sort(axis=-1)
    rank_x = _centred_sorted_np(a, buf) + k  # ≥ 1
    np.bitwise_and(a, _LOW, out=b)
    b <<= _32
    b |= rank_x.astype(np.uint64)
    b.sort(axis=-1)
    rank_y = _centred_sorted_np(b, buf)
    rank_x = np.bitwise_and(b, _LOW, out=a).view(np.int64)
    rank_x -= k
    return np.einsum("...k,...k->...", rank_x, np.broadcast_to(rank_y, rank_x.shape))


_ROWS_PER_TASK = 1024  # cache-sized blocks of rows; NumPy releases the GIL, so blocks run in threads
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def spearman_positive_np(x, y) -> np.ndarray:
    """NumPy twin of `spearman_positive` (values ranked as float32, as the samplers see them), exact
    (int64 numerator). On CPU it is far faster than XLA's sort, so `select` uses it there."""
    global _pool
    x = np.asarray(x, np.float32)
    y = np.broadcast_to(np.asarray(y, np.float32), x.shape)
    lead, k = x.shape[:-1], x.shape[-1]
    x, y = x.reshape(-1, k), y.reshape(-1, k)
    if x.shape[0] <= _ROWS_PER_TASK:
        out = _spearman_numerator_np(x, y) > 0
    else:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        tasks = range(0, x.shape[0], _ROWS_PER_TASK)
        out = np.concatenate(list(_pool.map(
            lambda i: _spearman_numerator_np(x[i:i + _ROWS_PER_TASK], y[i:i + _ROWS_PER_TASK]) > 0, tasks)))
    return out.reshape(lead)


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
