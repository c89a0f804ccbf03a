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
Combined GEM: ρ = Spearman(q, Δ) (scores ranked as float32); release b̃ = randomized response of 1[ρ > 0] with ε₁ = split·ε;
run mGEM if b̃ = 1 else GEM with ε₂ = (1 − split)·ε; ε = ε₁ + ε₂ by basic composition.

The min over b only needs b on the upper convex hull of the points (Δ_b, q_b − tΔ_b), a subset of the
Pareto frontier of (q_b − tΔ_b high, Δ_b low) (valid for every t; a frontier on (q, −Δ) is wrong for
t < 0). `frontier_size=m` walks at most m hull vertices in O(k·m) (a loop that stops once every row's
chain has ended) and falls back to the dense O(k²) formula when a chain is longer, so results are exact
(up to the rounding of the dtype: float64 in `select`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.selection import correlation, exact, rnm


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


def gem_scores_frontier(scores: jax.Array, sensitivities: jax.Array, shift,
                        frontier_size: int) -> tuple[jax.Array, jax.Array]:
    """`gem_scores` in O(k·m) for [..., k] inputs, m = the longest hull chain in the batch (≤ frontier_size).

    For λ ≤ 0, g(λ) = max_j (b_j + λ d_j) is attained on the upper convex hull of the points (d_j, b_j),
    and s_a = min_j (b_a − b_j)/(d_a + d_j) is the smallest λ with g(λ) ≥ b_a − λ d_a, so the minimum
    may be restricted to the hull's vertices left of the largest b (a subset of the Pareto frontier of
    (b high, d low); valid for any shift t). The walk starts at the largest b and steps to the point with
    smaller d minimising the slope (b_v − b_j)/(d_v − d_j) (ties: smallest d), folding each vertex into
    the running minimum; a row that has no point left of its vertex stays put. The loop stops when no row
    moves, or after `frontier_size` vertices. Only min/max reductions are used (argmin and gathers are
    slow on CPU). Returns (s [..., k], overflow [...]): s is exact where overflow is False (overflow:
    the chain had more than `frontier_size` vertices; use the dense formula there).
    """
    q = jnp.asarray(scores)
    d = jnp.broadcast_to(jnp.asarray(sensitivities, q.dtype), q.shape)
    shift = jnp.asarray(shift, q.dtype)[..., None] if jnp.ndim(shift) else shift
    b = q - shift * d
    bv = jnp.max(b, axis=-1, keepdims=True)
    dv = jnp.min(jnp.where(b == bv, d, jnp.inf), axis=-1, keepdims=True)
    s = jnp.minimum((b - bv) / (d + dv), 0.0)  # min(0, ·): the b = a term

    def step(carry):
        i, bv, dv, s, _ = carry
        left = d < dv
        slope = jnp.where(left, (bv - b) / jnp.where(left, dv - d, 1.0), jnp.inf)
        best = jnp.min(slope, axis=-1, keepdims=True)
        hit = left & (slope == best)
        d_new = jnp.min(jnp.where(hit, d, jnp.inf), axis=-1, keepdims=True)
        b_new = jnp.max(jnp.where(hit & (d == d_new), b, -jnp.inf), axis=-1, keepdims=True)
        moved = jnp.isfinite(best)
        bv, dv = jnp.where(moved, b_new, bv), jnp.where(moved, d_new, dv)
        return i + 1, bv, dv, jnp.minimum(s, (b - bv) / (d + dv)), jnp.any(moved)

    _, _, dv, s, _ = jax.lax.while_loop(lambda c: (c[0] < frontier_size - 1) & c[4], step, (0, bv, dv, s, True))
    return s, jnp.any(d < dv, axis=-1)


def _scores(q, d, t, frontier_size):
    """Exact normalised scores: frontier path with a dense fallback (lax.cond when unbatched)."""
    if frontier_size is None:
        return gem_scores(q, d, t)
    s, overflow = gem_scores_frontier(q, d, t, frontier_size)
    if q.ndim == 1:
        return jax.lax.cond(overflow, lambda: gem_scores(q, d, t), lambda: s)
    return jnp.where(overflow[..., None], gem_scores(q, d, t), s)


def _select_on(key, s, epsilon, base):
    if base == "em":
        return rnm.sample_softmax(key, epsilon * s / 2.0)
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
    return _select_on(key, _scores(scores, d, t, frontier_size), epsilon, base)


def mgem(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, beta: float = 0.5,
         shift=None, base: str = "em", frontier_size: int | None = None) -> jax.Array:
    """ε-DP modified GEM (negative shift t = −2 ln(k/β)/ε by default) -> int32 index."""
    return gem(key, scores, sensitivities, epsilon, beta, shift, base, frontier_size, negative=True)


def combined_gem(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, split: float = 0.5,
                 beta: float = 0.5, base: str = "em", frontier_size: int | None = None, positive=None) -> jax.Array:
    """ε-DP combined GEM: ε₁ = split·ε buys a randomized-response bit "Spearman(q, Δ) > 0"; the rest
    ε₂ runs mGEM (bit 1) or GEM (bit 0). The split is not recoverable from the paper; default 0.5 (even
    split). `positive`: the (non-released) bit `spearman_positive(scores, sensitivities)` if already computed."""
    k_rr, k_sel = jax.random.split(key)
    eps1, eps2 = split * epsilon, (1.0 - split) * epsilon
    d = jnp.broadcast_to(sensitivities, scores.shape)
    if positive is None:
        positive = correlation.spearman_positive(scores, d)
    keep = jax.random.uniform(k_rr, scores.shape[:-1]) < jax.nn.sigmoid(eps1)  # e^ε₁/(1 + e^ε₁)
    use_mgem = jnp.where(keep, positive, ~positive)
    t = default_shift(scores.shape[-1], eps2, beta)
    shift = jnp.where(use_mgem, -t, t)
    return _select_on(k_sel, _scores(scores, d, shift, frontier_size), eps2, base)


# --------------------------------------------------------------------------------------------------
# Batch fast paths for `select`: frontier scores without the dense fallback, plus the overflow flag
# (rows that overflow are recomputed densely with fresh randomness by the caller, so every row's
# output has exactly the mechanism's distribution).
def gem_fast(key, scores, sensitivities, epsilon, beta: float = 0.5, shift=None, base: str = "em",
             frontier_size: int = 16, negative: bool = False):
    """GEM/mGEM on [B, k] -> (int32 [B], overflow [B])."""
    t = default_shift(scores.shape[-1], epsilon, beta, negative) if shift is None else shift
    s, overflow = gem_scores_frontier(scores, sensitivities, t, frontier_size)
    return _select_on(key, s, epsilon, base), overflow


def combined_gem_fast(key, scores, sensitivities, epsilon, split: float = 0.5, beta: float = 0.5,
                      base: str = "em", frontier_size: int = 16, positive=None):
    """Combined GEM on [B, k] -> (int32 [B], overflow [B]). `positive` [B]: the (non-released) bits
    `spearman_positive(scores, sensitivities)` if already computed (NumPy on CPU, see `select`)."""
    k_rr, k_sel = jax.random.split(key)
    eps1, eps2 = split * epsilon, (1.0 - split) * epsilon
    d = jnp.broadcast_to(sensitivities, scores.shape)
    if positive is None:
        positive = correlation.spearman_positive(scores, d)
    keep = jax.random.uniform(k_rr, scores.shape[:-1]) < jax.nn.sigmoid(eps1)
    t = default_shift(scores.shape[-1], eps2, beta)
    shift = jnp.where(jnp.where(keep, positive, ~positive), -t, t)
    s, overflow = gem_scores_frontier(scores, d, shift, frontier_size)
    return _select_on(k_sel, s, eps2, base), overflow


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


def combined_gem_probabilities(scores, sensitivities, epsilon, split: float = 0.5, beta: float = 0.5,
                               base: str = "em", **_) -> np.ndarray:
    """Exact P[a] of combined GEM: mixture of mGEM and GEM at ε₂ weighted by the RR bit, [..., k]."""
    q = np.asarray(scores, np.float64)
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    eps1, eps2 = split * float(epsilon), (1.0 - split) * float(epsilon)
    positive = correlation.spearman_positive_np(q, d)
    p_keep = 1.0 / (1.0 + math.exp(-eps1))
    p_m = np.where(positive, p_keep, 1.0 - p_keep)[..., None]
    return p_m * mgem_probabilities(q, d, eps2, beta, None, base) + (1 - p_m) * gem_probabilities(
        q, d, eps2, beta, None, base)
