"""Generalised exponential mechanism (GEM), its negative-shift variant mGEM, and combined GEM.

Privacy: ε-DP for the released index, for public per-candidate sensitivities Δ_a > 0 with
|q_a(D) − q_a(D')| ≤ Δ_a on neighbouring datasets D ~ D' (unit and relation are those of the
caller's scores). Δ_a must not depend on the private data.

GEM (Raskhodnikova & Smith 2016), maximisation form, for a PUBLIC shift t:
    s_a = min_b [(q_a − tΔ_a) − (q_b − tΔ_b)] / (Δ_a + Δ_b)  ≤ 0,
each pairwise term moves by ≤ (Δ_a + Δ_b)/(Δ_a + Δ_b) = 1, so s has sensitivity 1 for ANY
data-independent t; then select with the exponential mechanism on s at sensitivity 1 (base="em",
as in private-pgm) or permute-and-flip/RNM-exp (base="pf").
  GEM:  t = 2 ln(k/β)/ε  (penalises sensitive candidates; β = 0.5 by default, as in private-pgm),
  mGEM: t = −2 ln(k/β)/ε (rewards sensitive candidates; the paper's exact value was not recoverable,
        this mirror image of GEM's shift is our documented default; pass `shift` to override).
Combined GEM: ρ = Spearman(q, Δ); release b̃ = randomized response of 1[ρ > 0] with ε₁ = split·ε;
run mGEM if b̃ = 1 else GEM with ε₂ = (1 − split)·ε; ε = ε₁ + ε₂ by basic composition.

The min over b only needs b on the Pareto frontier of (q_b − tΔ_b high, Δ_b low) (valid for every t;
the frontier on (q, −Δ) is wrong for t < 0); `frontier_size` uses it with a static cap that the caller
must make large enough (`select` computes it exactly on the host).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.selection import correlation, exact


def default_shift(k: int, epsilon, beta: float = 0.5, negative: bool = False):
    """t = ±2 ln(k/β)/ε (− for mGEM)."""
    t = 2.0 * math.log(k / beta) / epsilon
    return -t if negative else t


def gem_scores(scores: jax.Array, sensitivities: jax.Array, shift) -> jax.Array:
    """Normalised scores s [..., k] (dense O(k²) minimum); sensitivity 1 for any public shift."""
    q = jnp.asarray(scores)
    d = jnp.broadcast_to(jnp.asarray(sensitivities, q.dtype), q.shape)
    shift = jnp.asarray(shift, q.dtype)[..., None] if jnp.ndim(shift) else shift
    b = q - shift * d
    pair = (b[..., :, None] - b[..., None, :]) / (d[..., :, None] + d[..., None, :])
    return jnp.min(pair, axis=-1)


def frontier_mask(scores: jax.Array, sensitivities: jax.Array, shift) -> jax.Array:
    """Boolean [k]: candidates on the Pareto frontier of (B = q − tΔ high, Δ low), in input order."""
    b = scores - shift * sensitivities
    order = jnp.lexsort((-b, sensitivities))  # Δ ascending, B descending within ties
    bs = b[order]
    prev_max = jnp.concatenate([jnp.full((1,), -jnp.inf, bs.dtype), jax.lax.cummax(bs)[:-1]])
    return jnp.zeros(scores.shape, bool).at[order].set(bs > prev_max)


def gem_scores_frontier(scores: jax.Array, sensitivities: jax.Array, shift, frontier_size: int) -> jax.Array:
    """Same as `gem_scores` for one problem [k], in O(k log k + k·frontier_size). Exact only when the
    frontier has at most `frontier_size` points (see `frontier_mask`)."""
    d = jnp.broadcast_to(sensitivities, scores.shape)
    b = scores - shift * d
    (idx,) = jnp.nonzero(frontier_mask(scores, d, shift), size=frontier_size, fill_value=jnp.argmax(b))
    pair = (b[:, None] - b[idx][None, :]) / (d[:, None] + d[idx][None, :])
    return jnp.minimum(jnp.min(pair, axis=-1), 0.0)  # the b = a term is 0


def _select_on(key, s, epsilon, base):
    if base == "em":
        return jax.random.categorical(key, epsilon * s / 2.0, axis=-1).astype(jnp.int32)
    if base == "pf":
        noise = jax.random.exponential(key, s.shape, s.dtype)
        return jnp.argmax(s + (2.0 / epsilon) * noise, axis=-1).astype(jnp.int32)
    raise ValueError(f"base must be 'em' or 'pf', got {base!r}")


def gem(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, beta: float = 0.5,
        shift=None, base: str = "em", frontier_size: int | None = None, negative: bool = False) -> jax.Array:
    """ε-DP GEM on one problem (scores, sensitivities [k]) -> int32 index. `shift` overrides
    t = 2 ln(k/β)/ε (it must be public); `negative=True` gives mGEM's default shift."""
    k = scores.shape[-1]
    t = default_shift(k, epsilon, beta, negative) if shift is None else shift
    d = jnp.broadcast_to(sensitivities, scores.shape)
    if frontier_size is None:
        s = gem_scores(scores, d, t)
    else:
        s = gem_scores_frontier(scores, d, t, frontier_size)
    return _select_on(key, s, epsilon, base)


def mgem(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, beta: float = 0.5,
         shift=None, base: str = "em", frontier_size: int | None = None) -> jax.Array:
    """ε-DP modified GEM (negative shift t = −2 ln(k/β)/ε by default) -> int32 index."""
    return gem(key, scores, sensitivities, epsilon, beta, shift, base, frontier_size, negative=True)


def combined_gem(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, split: float = 0.25,
                 beta: float = 0.5, base: str = "em", frontier_size: int | None = None) -> jax.Array:
    """ε-DP combined GEM: ε₁ = split·ε buys a randomized-response bit "Spearman(q, Δ) > 0"; the rest
    ε₂ runs mGEM (bit 1) or GEM (bit 0). The split is not recoverable from the paper; default 0.25."""
    k_rr, k_sel = jax.random.split(key)
    eps1, eps2 = split * epsilon, (1.0 - split) * epsilon
    d = jnp.broadcast_to(sensitivities, scores.shape)
    positive = correlation.spearman(scores, d) > 0
    keep = jax.random.uniform(k_rr, scores.shape[:-1]) < jax.nn.sigmoid(eps1)  # e^ε₁/(1 + e^ε₁)
    use_mgem = jnp.where(keep, positive, ~positive)
    t = default_shift(scores.shape[-1], eps2, beta)
    shift = jnp.where(use_mgem, -t, t)
    if frontier_size is None:
        s = gem_scores(scores, d, shift)
    else:
        s = gem_scores_frontier(scores, d, shift, frontier_size)
    return _select_on(k_sel, s, eps2, base)


# --------------------------------------------------------------------------------------------------
# Exact output probabilities, [..., k] float64 (host side).
def _gem_scores_np(scores, sensitivities, shift):
    q = np.asarray(scores, np.float64)
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    shift = np.asarray(shift, np.float64)
    shift = shift[..., None] if shift.ndim else shift
    b = q - shift * d
    return np.min((b[..., :, None] - b[..., None, :]) / (d[..., :, None] + d[..., None, :]), axis=-1)


def gem_scores_np(scores, sensitivities, shift) -> np.ndarray:
    """float64 reference of `gem_scores` (used by tests and exact probabilities)."""
    return _gem_scores_np(scores, sensitivities, shift)


def _probs_on(s, epsilon, base):
    if base == "em":
        z = epsilon * s / 2.0
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if base == "pf":
        return exact.noisy_max_probabilities(s, np.full(s.shape, 2.0 / epsilon), "exponential")
    raise ValueError(f"base must be 'em' or 'pf', got {base!r}")


def gem_probabilities(scores, sensitivities, epsilon, beta: float = 0.5, shift=None, base: str = "em",
                      negative: bool = False, **_) -> np.ndarray:
    """Exact P[a] of GEM (mGEM with negative=True), [..., k]."""
    q = np.asarray(scores, np.float64)
    t = default_shift(q.shape[-1], float(epsilon), beta, negative) if shift is None else shift
    return _probs_on(_gem_scores_np(q, sensitivities, t), float(epsilon), base)


def mgem_probabilities(scores, sensitivities, epsilon, beta: float = 0.5, shift=None, base: str = "em",
                       **_) -> np.ndarray:
    """Exact P[a] of mGEM, [..., k]."""
    return gem_probabilities(scores, sensitivities, epsilon, beta, shift, base, negative=True)


def combined_gem_probabilities(scores, sensitivities, epsilon, split: float = 0.25, beta: float = 0.5,
                               base: str = "em", **_) -> np.ndarray:
    """Exact P[a] of combined GEM: mixture of mGEM and GEM at ε₂ weighted by the RR bit, [..., k]."""
    q = np.asarray(scores, np.float64)
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    eps1, eps2 = split * float(epsilon), (1.0 - split) * float(epsilon)
    positive = np.asarray(correlation.spearman(q, d)) > 0
    p_keep = 1.0 / (1.0 + math.exp(-eps1))
    p_m = np.where(positive, p_keep, 1.0 - p_keep)[..., None]
    return p_m * mgem_probabilities(q, d, eps2, beta, None, base) + (1 - p_m) * gem_probabilities(
        q, d, eps2, beta, None, base)
