"""Report-noisy-max (RNM), the exponential mechanism (EM) and permute-and-flip (PF).

Privacy: ε-DP for the released index. Unit of privacy and neighbouring relation are those of the
caller's score function: for neighbouring datasets D ~ D' every score moves by at most its public
sensitivity, |q_a(D) − q_a(D')| ≤ Δ_a. These homogeneous mechanisms calibrate to Δ = max_a Δ_a.
`monotone=True` may be used only when, for every neighbouring pair, all scores move in the same
direction (e.g. add/remove counting queries); it halves the noise.

Noise scale b = 2Δ/ε (Δ/ε if monotone):
  rnm_exponential: argmax q_a + Exp(b)   (identical in distribution to permute-and-flip)
  rnm_gumbel:      argmax q_a + Gumbel(b) (identical to the exponential mechanism)
  rnm_laplace:     argmax q_a + Laplace(b)
  exponential_mechanism: P[a] ∝ exp(q_a / b)
  permute_and_flip: visit candidates in random order, accept r w.p. exp((q_r − q*)/b).
Floating-point samplers are not exactly DP (Mironov 2012): `select` runs them in float64 so every
realised output probability is within ~k·2^-52 of the exact law (float32: ~2^-23); this is a research
implementation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdp import noise
from jdp.selection import exact


def noise_scale(sensitivities: jax.Array, epsilon, monotone: bool = False) -> jax.Array:
    """b = (2 or 1)·max_a Δ_a / ε for the homogeneous mechanisms, shape [..., 1]."""
    return (1.0 if monotone else 2.0) * jnp.max(sensitivities, axis=-1, keepdims=True) / epsilon


def _report_noisy_max(sampler, key, scores, sensitivities, epsilon, monotone):
    """argmax(q + Z), Z iid from `sampler` (jdp.noise.exponential / gumbel / laplace) at scale b per candidate."""
    b = noise_scale(sensitivities, epsilon, monotone)
    return jnp.argmax(scores + sampler(key, scores.shape, b, scores.dtype), axis=-1).astype(jnp.int32)


def rnm_exponential(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon,
                    monotone: bool = False) -> jax.Array:
    """ε-DP report-noisy-max with exponential noise; scores [..., k], sensitivities [k] or [..., k] -> int32 [...]."""
    return _report_noisy_max(noise.exponential, key, scores, sensitivities, epsilon, monotone)


def rnm_gumbel(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon,
               monotone: bool = False) -> jax.Array:
    """ε-DP report-noisy-max with Gumbel noise (= exponential mechanism); [k] -> int32 index."""
    return _report_noisy_max(noise.gumbel, key, scores, sensitivities, epsilon, monotone)


def rnm_laplace(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon,
                monotone: bool = False) -> jax.Array:
    """ε-DP report-noisy-max with Laplace noise; [k] -> int32 index."""
    return _report_noisy_max(noise.laplace, key, scores, sensitivities, epsilon, monotone)


def sample_softmax(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from P[a] ∝ exp(logits_a), [..., k] -> int32 [...], by inverse CDF.

    Uses ONE uniform per row, where Gumbel-max (`jax.random.categorical`) needs k; on CPU the random
    bits dominate the cost. u lies in (0, total], so a candidate of probability 0 is never returned.
    Exactness is that of the dtype: the cumulative sums and the uniform's grid resolve probabilities to
    ~k·u of the row total (u = 2^-53 in float64, as `select` runs it: every realised probability is
    within ~k·2^-52 of the exact one; in float32 the error is ~k·2^-23, a δ of that size, which is why
    `select` no longer samples in float32).
    """
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    c = jnp.cumsum(p, axis=-1)
    u = (1.0 - jax.random.uniform(key, logits.shape[:-1] + (1,), logits.dtype)) * c[..., -1:]
    return jnp.sum(c < u, axis=-1).astype(jnp.int32)


def exponential_mechanism(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon,
                          monotone: bool = False) -> jax.Array:
    """ε-DP exponential mechanism P[a] ∝ exp(ε q_a / (2Δ)); [k] -> int32 index."""
    b = noise_scale(sensitivities, epsilon, monotone)
    return sample_softmax(key, scores / b)


def permute_and_flip(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon,
                     monotone: bool = False) -> jax.Array:
    """ε-DP permute-and-flip (McKenna & Sheldon 2020), vectorised: every candidate flips its coin
    Bernoulli(exp((q_r − q*)/b)) and a uniformly random order picks the first accepted one (the argmax
    always accepts, so the output is well defined). [k] -> int32 index."""
    b = noise_scale(sensitivities, epsilon, monotone)
    k_flip, k_order = jax.random.split(key)
    top = jnp.max(scores, axis=-1, keepdims=True)
    accept = jax.random.uniform(k_flip, scores.shape) < jnp.exp((scores - top) / b)
    accept = accept | (jnp.arange(scores.shape[-1]) == jnp.argmax(scores, axis=-1, keepdims=True))
    order = jax.random.uniform(k_order, scores.shape)
    return jnp.argmin(jnp.where(accept, order, 2.0), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------
# Exact output probabilities, [..., k] float64 (host side).
def _scale_np(sensitivities, shape, epsilon, monotone):
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), shape)
    b = (1.0 if monotone else 2.0) * d.max(-1, keepdims=True) / float(epsilon)
    return np.broadcast_to(b, shape)


def exponential_mechanism_probabilities(scores, sensitivities, epsilon, monotone: bool = False) -> np.ndarray:
    """softmax(q / b), [..., k]."""
    q = np.asarray(scores, np.float64)
    z = q / _scale_np(sensitivities, q.shape, epsilon, monotone)
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def rnm_exponential_probabilities(scores, sensitivities, epsilon, monotone: bool = False) -> np.ndarray:
    """Exact P[a] of exponential-noise RNM (= permute-and-flip) by quadrature, [..., k]."""
    q = np.asarray(scores, np.float64)
    return exact.noisy_max_probabilities(q, _scale_np(sensitivities, q.shape, epsilon, monotone), "exponential")


def rnm_laplace_probabilities(scores, sensitivities, epsilon, monotone: bool = False) -> np.ndarray:
    """Exact P[a] of Laplace-noise RNM by quadrature, [..., k]."""
    q = np.asarray(scores, np.float64)
    return exact.noisy_max_probabilities(q, _scale_np(sensitivities, q.shape, epsilon, monotone), "laplace")


rnm_gumbel_probabilities = exponential_mechanism_probabilities
permute_and_flip_probabilities = rnm_exponential_probabilities
