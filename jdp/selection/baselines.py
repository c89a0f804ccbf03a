"""Baselines: k-ary randomized response on the argmax (kRR), uniform selection, and RNMH, the
heterogeneous-noise report-noisy-max that is NOT differentially private (reference only).

kRR privacy: ε-DP for any k-valued function of the data (here the exact argmax), whatever the
neighbouring relation of the caller's data; no sensitivities are used. Uniform: 0-DP (ignores data).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.selection import exact


def krr(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon) -> jax.Array:
    """ε-DP: the exact argmax w.p. e^ε/(e^ε + k − 1), any other candidate w.p. 1/(e^ε + k − 1) each."""
    k = scores.shape[-1]
    batch = scores.shape[:-1]
    best = jnp.argmax(scores, axis=-1)
    k_keep, k_other = jax.random.split(key)
    p_keep = 1.0 / (1.0 + (k - 1) * jnp.exp(-epsilon))  # = e^ε/(e^ε + k − 1), overflow-free
    other = (best + 1 + jax.random.randint(k_other, batch, 0, max(k - 1, 1))) % k
    return jnp.where(jax.random.uniform(k_keep, batch) < p_keep, best, other).astype(jnp.int32)


def uniform(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon=None) -> jax.Array:
    """Uniformly random candidate (0-DP reference; ignores the scores)."""
    return jax.random.randint(key, scores.shape[:-1], 0, scores.shape[-1]).astype(jnp.int32)


def rnmh_nonprivate(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon) -> jax.Array:
    """NOT DIFFERENTIALLY PRIVATE. argmax q_a + Exp(2Δ_a/ε) with per-candidate scales.

    Reference only: with Δ_a → 0 and 0 < q_a − q_b ≤ Δ_b, P[a] > 0 on D but → 0 on a neighbour
    where q_b rises by Δ_b, so the privacy loss is unbounded. Never use it to release data.
    """
    scale = 2.0 * jnp.broadcast_to(sensitivities, scores.shape) / epsilon
    return jnp.argmax(scores + scale * jax.random.exponential(key, scores.shape, scores.dtype), axis=-1).astype(jnp.int32)


def krr_probabilities(scores, sensitivities, epsilon, **_) -> np.ndarray:
    q = np.asarray(scores, np.float64)
    k = q.shape[-1]
    other = 1.0 / (math.exp(min(float(epsilon), 700.0)) + k - 1)
    onehot = np.arange(k) == q.argmax(-1)[..., None]
    return np.where(onehot, 1.0 - (k - 1) * other, other)


def uniform_probabilities(scores, sensitivities=None, epsilon=None, **_) -> np.ndarray:
    q = np.asarray(scores, np.float64)
    return np.full(q.shape, 1.0 / q.shape[-1])


def rnmh_nonprivate_probabilities(scores, sensitivities, epsilon, **_) -> np.ndarray:
    q = np.asarray(scores, np.float64)
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    return exact.noisy_max_probabilities(q, 2.0 * d / float(epsilon), "exponential")
