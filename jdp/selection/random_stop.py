"""RS_γ: private selection by random stopping with heterogeneous Laplace noise.

Privacy: ε-DP for the released index, for public Δ_a > 0 with |q_a(D) − q_a(D')| ≤ Δ_a on
neighbouring datasets (unit and relation of the caller's scores).
Base mechanism Q (ε'-DP): draw a uniformly random candidate a (data independent) and release
q_a + Laplace(Δ_a/ε') — each candidate with its OWN sensitivity. Run Q K times, K random and
independent of the data, and output the candidate with the largest noisy value.
  stopping="geometric": K ~ Geometric(γ) on {1, 2, ...} (E[K] = 1/γ), 3ε'-DP (Liu & Talwar 2019);
  stopping="tnb": K ~ truncated negative binomial D_{η,γ} (η ≥ 0; η = 0 logarithmic), (2+η)ε'-DP
  (Papernot & Steinke 2022, Cor. 3).
So ε' = ε/3 or ε/(2+η). K is UNBOUNDED: the loop is a lax.while_loop over blocks of draws until K
draws were made (a truncated K would change the guarantee). Choose 1/γ of order k or larger so the
best candidate is seen; γ is OPEN in the paper, our default is γ = 1/k (E[K] = k).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.noise import laplace
from jdp.selection import exact

_K_MAX = 2**30  # int32 guard; P[K > 2^30] = (1-γ)^(2^30) is 0 in float64 for γ >= 1e-7


def epsilon_per_run(epsilon, stopping: str = "geometric", eta: float = 1.0):
    """ε' of each base run: ε/3 (geometric) or ε/(2+η) (tnb)."""
    return epsilon / (3.0 if stopping == "geometric" else 2.0 + eta)


def sample_stopping_time(key: jax.Array, gamma, stopping: str = "geometric", eta: float = 1.0) -> jax.Array:
    """K ≥ 1 (int32): Geometric(γ) or truncated negative binomial D_{η,γ}."""
    if stopping == "geometric" or (stopping == "tnb" and eta == 1.0):
        u = jax.random.uniform(key, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
        k = jnp.ceil(jnp.log(u) / jnp.log1p(-gamma))
        return jnp.clip(k, 1, _K_MAX).astype(jnp.int32)
    if stopping != "tnb":
        raise ValueError(f"stopping must be 'geometric' or 'tnb', got {stopping!r}")
    if eta == 0.0:  # logarithmic(p = 1 − γ), Kemp's algorithm as in numpy's logseries
        p = 1.0 - gamma
        k1, k2 = jax.random.split(key)
        v = jax.random.uniform(k1, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
        u = jax.random.uniform(k2)
        q = -jnp.expm1(jnp.log1p(-p) * u)
        big = jnp.floor(1.0 + jnp.log(v) / jnp.log(jnp.maximum(q, jnp.finfo(jnp.float32).tiny)))
        k = jnp.where(v >= p, 1.0, jnp.where(v <= q * q, big, jnp.where(v >= q, 1.0, 2.0)))
        return jnp.clip(k, 1, _K_MAX).astype(jnp.int32)

    # η > 0: K ~ Poisson(Gamma(η, (1−γ)/γ)) conditioned on K ≥ 1 (rejection, unbounded loop)
    def draw(carry):
        key, _ = carry
        key, kg, kp = jax.random.split(key, 3)
        lam = jax.random.gamma(kg, eta) * (1.0 - gamma) / gamma
        return key, jax.random.poisson(kp, lam).astype(jnp.int32)

    _, k = jax.lax.while_loop(lambda c: c[1] < 1, draw, (key, jnp.int32(0)))
    return jnp.minimum(k, _K_MAX)


def random_stopping(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, gamma=None,
                    stopping: str = "geometric", eta: float = 1.0, block: int | None = None) -> jax.Array:
    """ε-DP RS_γ on one problem (scores, sensitivities [k]) -> int32 index; γ defaults to 1/k.

    Draws are made `block` at a time (default min(k, 256)); draws beyond K are masked, the loop runs
    until K draws were made, so K is never truncated.
    """
    k = scores.shape[-1]
    gamma = 1.0 / k if gamma is None else gamma
    block = min(k, 256) if block is None else block
    d = jnp.broadcast_to(sensitivities, scores.shape)
    scale = d / epsilon_per_run(epsilon, stopping, eta)
    k_stop, k_loop = jax.random.split(key)
    n_draws = sample_stopping_time(k_stop, gamma, stopping, eta)

    def body(state):
        done, key, best_v, best_i = state
        key, kc, kn = jax.random.split(key, 3)
        cand = jax.random.randint(kc, (block,), 0, k, dtype=jnp.int32)
        vals = scores[cand] + laplace(kn, (block,), scale[cand], scores.dtype)
        vals = jnp.where(done + jnp.arange(block) < n_draws, vals, -jnp.inf)
        j = jnp.argmax(vals)
        better = vals[j] > best_v
        return (done + block, key, jnp.where(better, vals[j], best_v), jnp.where(better, cand[j], best_i))

    init = (jnp.int32(0), k_loop, jnp.array(-jnp.inf, scores.dtype), jnp.int32(0))
    _, _, _, best = jax.lax.while_loop(lambda s: s[0] < n_draws, body, init)
    return best.astype(jnp.int32)


def random_stopping_batch(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon, gamma=None,
                          stopping: str = "geometric", eta: float = 1.0, chunk: int = 1 << 17) -> jax.Array:
    """RS_γ on every row of scores [B, k] -> int32 [B], with exactly the per-row distribution.

    All rows' draws form one stream: row i owns positions [start_i, start_i + K_i). The stream is
    processed `chunk` positions at a time (row = searchsorted of the position), each row keeping its best
    noisy value with segment maxima; the loop runs until every K_i draws were made (unbounded K).
    Total work is Σ K_i draws instead of B · max K_i for a vmapped loop.
    """
    n_rows, k = scores.shape
    gamma = 1.0 / k if gamma is None else gamma
    d = jnp.broadcast_to(sensitivities, scores.shape)
    scale = d / epsilon_per_run(epsilon, stopping, eta)
    k_stop, k_loop = jax.random.split(key)
    n_draws = jax.vmap(lambda kk: sample_stopping_time(kk, gamma, stopping, eta))(jax.random.split(k_stop, n_rows))
    ends = jnp.cumsum(n_draws)  # int32: callers keep Σ K < 2^31 (checked in `select`)
    total = ends[-1]
    flat_q, flat_s = scores.reshape(-1), scale.reshape(-1)

    def body(state):
        off, key, best_v, best_i = state
        key, kc, kn = jax.random.split(key, 3)
        pos = off + jnp.arange(chunk, dtype=jnp.int32)
        row = jnp.minimum(jnp.searchsorted(ends, pos, side="right"), n_rows - 1).astype(jnp.int32)
        cand = jax.random.randint(kc, (chunk,), 0, k, dtype=jnp.int32)
        flat = row * k + cand
        vals = flat_q[flat] + laplace(kn, (chunk,), flat_s[flat], scores.dtype)
        vals = jnp.where(pos < total, vals, -jnp.inf)
        seg_v = jax.ops.segment_max(vals, row, num_segments=n_rows, indices_are_sorted=True)
        hit = (vals == seg_v[row]) & (pos < total)
        seg_i = jax.ops.segment_max(jnp.where(hit, cand, -1), row, num_segments=n_rows, indices_are_sorted=True)
        better = seg_v > best_v
        return off + chunk, key, jnp.where(better, seg_v, best_v), jnp.where(better, seg_i, best_i)

    init = (jnp.int32(0), k_loop, jnp.full((n_rows,), -jnp.inf, scores.dtype), jnp.zeros((n_rows,), jnp.int32))
    _, _, _, best = jax.lax.while_loop(lambda st: st[0] < total, body, init)
    return best.astype(jnp.int32)


def _rate_after_first_arrival(key: jax.Array, rows: tuple, eta: float, gamma) -> jax.Array:
    """Λ(1 − T) per row: Λ ~ Gamma(η)·(1−γ)/γ conditioned on K ≥ 1 (proposals accepted with probability
    1 − e^(−Λ)), T the first arrival of the rate-Λ process on [0, 1] given that there is one."""
    def propose(key):
        kg, ku = jax.random.split(key)
        lam = jax.random.gamma(kg, eta, rows) * ((1.0 - gamma) / gamma)
        return lam, jax.random.uniform(ku, rows) < -jnp.expm1(-lam)

    def body(state):
        key, lam, pending = state
        key, sub = jax.random.split(key)
        new, ok = propose(sub)
        return key, jnp.where(pending & ok, new, lam), pending & ~ok

    k_loop, k_first = jax.random.split(key)
    lam, ok = propose(jax.random.fold_in(k_loop, 0))
    _, lam, _ = jax.lax.while_loop(lambda s: jnp.any(s[2]), body, (k_loop, lam, ~ok))
    u = jax.random.uniform(k_first, rows)
    first = -jnp.log1p(u * jnp.expm1(-lam)) / lam  # T on [0, 1]
    return lam * (1.0 - first)


def random_stopping_poissonized(key: jax.Array, scores: jax.Array, sensitivities: jax.Array, epsilon,
                                gamma=None, stopping: str = "geometric", eta: float = 1.0) -> jax.Array:
    """RS_γ on [..., k] with exactly the same output distribution, in O(k) dense work per problem.

    For η > 0 (geometric: η = 1), K ~ Poisson(Λ) conditioned on K ≥ 1, Λ ~ Gamma(η)·(1−γ)/γ. View the
    K base runs as the arrivals of a rate-Λ Poisson process on [0, 1] conditioned on at least one:
      1. Λ | K ≥ 1: Gamma draw accepted with probability 1 − e^(−Λ) (a cheap per-problem loop);
      2. the first arrival T has density ∝ e^(−Λt) on [0, 1] (inverse CDF); it is one base run on a
         uniformly random candidate a₀ with one Laplace draw;
      3. the arrivals after T are Poisson(Λ(1 − T)), each on a uniform candidate, so candidate a gets
         N_a ~ Poisson(r), r = Λ(1 − T)/k, independently; the best of its noisy values has
         P[M_a ≤ x] = exp(−r(1 − F((x − q_a)/s_a))), M_a = −∞ when N_a = 0. With E_a ~ Exp(1):
         M_a = −∞ if E_a > r, else 1 − F = E_a/r, inverted in closed form.
    The output is argmax_a max(M_a, the a₀ draw). K is unbounded and never truncated. Needs η > 0.
    For η = 1 (geometric K) steps 1-2 simplify: K − 1 ~ Geometric on {0, 1, ...} = Poisson(Λ'), Λ' ~
    Exp·(1−γ)/γ, so the a₀ draw plus Poisson(Λ'/k) counts per candidate, with no conditioning.
    """
    if stopping == "geometric":
        eta = 1.0
    elif stopping != "tnb":
        raise ValueError(f"stopping must be 'geometric' or 'tnb', got {stopping!r}")
    if not eta > 0:
        raise ValueError("the Poissonized sampler needs eta > 0 (eta = 0 is the logarithmic case)")
    k = scores.shape[-1]
    gamma = 1.0 / k if gamma is None else gamma
    q = scores
    scale = jnp.broadcast_to(sensitivities, q.shape) / epsilon_per_run(epsilon, stopping, eta)
    rows = q.shape[:-1]
    k_lam, k_a0, k_lap, k_rest = jax.random.split(key, 4)
    if eta == 1.0:  # geometric: K = 1 + Poisson(Λ'), Λ' ~ Exp·(1−γ)/γ unconditioned (no loop, no T)
        rate = (jax.random.exponential(k_lam, rows) * ((1.0 - gamma) / gamma / k))[..., None]
    else:
        rate = _rate_after_first_arrival(k_lam, rows, eta, gamma)[..., None] / k
    a0 = jax.random.randint(k_a0, rows, 0, k, dtype=jnp.int32)
    q0 = jnp.take_along_axis(q, a0[..., None], -1)[..., 0]
    s0 = jnp.take_along_axis(scale, a0[..., None], -1)[..., 0]
    v0 = q0 + laplace(k_lap, rows, s0, q.dtype)

    u = jax.random.uniform(k_rest, q.shape, q.dtype, minval=jnp.finfo(q.dtype).tiny)
    w = jnp.log(u) * (-2.0 / rate)  # w = 2·(1 − F(x)) with E_a = −ln u; a draw exists iff w ≤ 2
    lower = w <= 1.0  # Laplace survival inverse, one log: x = −ln w (w ≤ 1), ln(2 − w) (1 < w ≤ 2)
    x = jnp.log(jnp.where(lower, w, 2.0 - w))
    vals = jnp.where(w <= 2.0, q + scale * jnp.where(lower, -x, x), -jnp.inf)
    vals = jnp.where(jnp.arange(k) == a0[..., None], jnp.maximum(vals, v0[..., None]), vals)
    return jnp.argmax(vals, axis=-1).astype(jnp.int32)


def stopping_pgf_derivative(gamma: float, stopping: str = "geometric", eta: float = 1.0):
    """Φ'(s) of the stopping-time distribution (NumPy)."""
    if stopping == "geometric" or (stopping == "tnb" and eta == 1.0):
        return lambda s: gamma / (1.0 - (1.0 - gamma) * s) ** 2
    if stopping != "tnb":
        raise ValueError(f"stopping must be 'geometric' or 'tnb', got {stopping!r}")
    if eta == 0.0:
        return lambda s: (1.0 - gamma) / ((1.0 - (1.0 - gamma) * s) * math.log(1.0 / gamma))
    return lambda s: eta * (1.0 - gamma) * (1.0 - (1.0 - gamma) * s) ** (-eta - 1.0) / (gamma ** (-eta) - 1.0)


def expected_stopping_time(gamma: float, stopping: str = "geometric", eta: float = 1.0) -> float:
    """E[K]: 1/γ (geometric), η(1−γ)/(γ(1−γ^η)) (tnb, η>0), (1/γ−1)/ln(1/γ) (η=0)."""
    if stopping == "geometric" or eta == 1.0:
        return 1.0 / gamma
    if eta == 0.0:
        return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
    return eta * (1.0 - gamma) / (gamma * (1.0 - gamma ** eta))


def random_stopping_probabilities(scores, sensitivities, epsilon, gamma=None, stopping: str = "geometric",
                                  eta: float = 1.0, **_) -> np.ndarray:
    """Exact P[a] of RS_γ by the generating-function integral, [..., k]."""
    q = np.asarray(scores, np.float64)
    k = q.shape[-1]
    gamma = 1.0 / k if gamma is None else float(gamma)
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    scale = d / epsilon_per_run(float(epsilon), stopping, eta)
    return exact.random_stopping_probabilities(q, scale, stopping_pgf_derivative(gamma, stopping, eta))
