"""Two-arm bandit with distribution shift: non-private UCB vs private learners.

Privacy unit: one reward (event-level DP over the reward stream); neighbouring streams differ in one
reward in [0, 1]. Pieces:
- `hybrid_counter_noise`: the noise of Chan-Shi-Song's hybrid continual counter (logarithmic part
  ε/2 + binary-tree parts ε/2, horizon-free). Its noise is additive and data independent, so a
  counter's outputs are prefix_sum(n) + noise[n]; each reward enters at most one logarithmic interval
  sum and ≤ L tree nodes, giving ε-DP for the whole output sequence.
- `dp_quantile`: Smith's exponential-mechanism quantile on a public range (ε-DP, static shapes).
- Learners: "ucb" (non-private), "dp-ucb" (UCB on hybrid-counter means; ε per reward, arms' streams
  are disjoint), "window-<mechanism>" (scores = time-window arm means clipped to DP-quantile ranges,
  heterogeneous sensitivities Δ_a = (hi_a − lo_a)/n_a, arm chosen by a private selection mechanism;
  each reward influences W selections and ≤ 2(⌈W/P⌉ + 1) quantile releases — all recorded in a
  PrivacyReport).
The bandit design (arms, horizon, shift, window) is ours; the paper's exact set-up was not recoverable.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.accounting import REPLACE_ONE, PrivacyReport, pure_dp_event
from jdp.noise import laplace
from jdp.selection.registry import get_mechanism
from jdp.validation import check_epsilon


def hybrid_counter_noise(key: jax.Array, horizon: int, epsilon: float) -> np.ndarray:
    """noise[n] for n = 1..horizon (index 0 unused) of the hybrid continual counter at ε (sensitivity 1)."""
    epsilon = check_epsilon(epsilon)
    half = epsilon / 2.0
    j_max = max(1, math.ceil(math.log2(horizon + 1)))
    k_log, k_tree = jax.random.split(key)
    log_noise = np.asarray(laplace(k_log, (j_max + 1,), 1.0)) / half  # one per interval (2^{i-1}, 2^i]
    noise = np.zeros(horizon + 1)
    n = np.arange(1, horizon + 1)
    j = np.floor(np.log2(n)).astype(np.int64)  # n = 2^j + r, 0 <= r < 2^j
    r = n - (1 << j)
    noise[1:] = np.cumsum(log_noise)[j]  # L(2^j): noisy sums of the intervals up to 2^j
    for jj in range(1, int(j.max()) + 1):  # binary mechanism B_jj (horizon 2^jj − 1, jj levels)
        sel = (j == jj) & (r > 0)
        if not sel.any():
            continue
        lap = np.asarray(laplace(jax.random.fold_in(k_tree, jj), (jj, 1 << jj), 1.0)) * (jj / half)
        rr = r[sel]
        for i in range(jj):  # dyadic node (level i, index r >> i) when bit i of r is set
            noise[1:][sel] += np.where((rr >> i) & 1, lap[i, rr >> i], 0.0)
    return noise


@jax.jit
def dp_quantile(key: jax.Array, x: jax.Array, mask: jax.Array, p, epsilon, lo, hi) -> jax.Array:
    """ε-DP p-quantile (Smith 2011) of the masked values of x [n] clipped to the public [lo, hi]."""
    n = jnp.sum(mask)
    xs = jnp.sort(jnp.where(mask, jnp.clip(x, lo, hi), hi))  # masked entries pushed to hi (padding)
    edges = jnp.concatenate([jnp.array([lo], x.dtype), xs, jnp.array([hi], x.dtype)])
    i = jnp.arange(x.shape[0] + 1)
    valid = i <= n
    edges = jnp.where(jnp.arange(x.shape[0] + 2) <= n, edges, hi)
    width = edges[1:] - edges[:-1]
    logits = jnp.where(valid & (width > 0), jnp.log(jnp.maximum(width, 1e-30)) - epsilon / 2 * jnp.abs(i - p * n),
                       -jnp.inf)
    k1, k2 = jax.random.split(key)
    j = jax.random.categorical(k1, logits)
    return edges[j] + jax.random.uniform(k2) * width[j]


@dataclasses.dataclass(frozen=True)
class ShiftBandit:
    """Two arms with clipped Gaussian rewards; means and spreads swap at `shift_at`."""
    horizon: int = 4000
    shift_at: int = 2000
    means: tuple = (0.6, 0.45)
    stds: tuple = (0.05, 0.3)

    def rewards(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        t = np.arange(self.horizon)[:, None]
        mu = np.where(t < self.shift_at, self.means, self.means[::-1])
        sd = np.where(t < self.shift_at, self.stds, self.stds[::-1])
        return np.clip(mu + sd * rng.normal(size=(self.horizon, 2)), 0.0, 1.0)


def run_learner(learner: str, bandit: ShiftBandit, rewards: np.ndarray, key: jax.Array, epsilon: float = 10.0,
                window: int = 400, period: int = 100, quantile_share: float = 0.2) -> dict:
    """Plays one learner on a reward table [T, 2]; returns cumulative reward and the privacy report."""
    T = bandit.horizon
    report = PrivacyReport(delta=1e-6, unit="reward (in [0, 1])", relation=REPLACE_ONE)
    pulls, got = np.zeros(T, np.int64), np.zeros(T)
    sums, counts = np.zeros(2), np.zeros(2, np.int64)
    if learner == "dp-ucb":
        check_epsilon(epsilon)
        k0, k1 = jax.random.split(key)
        noise = [hybrid_counter_noise(k0, T, epsilon), hybrid_counter_noise(k1, T, epsilon)]
        report.add("hybrid counters (arms' streams disjoint)", pure_dp_event(epsilon))
    elif learner.startswith("window-"):
        mech = get_mechanism(learner[len("window-"):])
        n_q = 2 * (math.ceil(window / period) + 1)
        eps_q = quantile_share * epsilon / n_q
        # the selection's recorded bound includes float64 rounding (`Mechanism.guaranteed_epsilon`): run it at
        # the parameter whose bound is the share, so the report's total is the requested ε
        eps_sel = (1 - quantile_share) * epsilon / window / mech.guaranteed_epsilon(1.0)
        report.add("DP quantile (lo, hi) per arm", pure_dp_event(eps_q), count=n_q)
        report.add(f"select:{mech.name} per step", mech.dp_event(eps_sel), count=window)
        lo, hi = np.zeros(2), np.ones(2)
        buf = np.zeros((2, window), np.float32)
        buf_t = -np.ones((2, window), np.int64)
        sample = jax.jit(lambda k, q, d, e: mech.sample(k, q, d, e))
    elif learner != "ucb":
        raise ValueError(f"learner must be 'ucb', 'dp-ucb' or 'window-<mechanism>', got {learner!r}")
    for t in range(T):
        if t < 2:
            a = t
        elif learner == "ucb":
            a = int(np.argmax(sums / counts + np.sqrt(2 * np.log(t) / counts)))
        elif learner == "dp-ucb":
            noisy = np.array([sums[i] + noise[i][counts[i]] for i in range(2)])
            a = int(np.argmax(noisy / counts + np.sqrt(2 * np.log(t) / counts)))
        else:
            kt = jax.random.fold_in(key, t)
            if t % period == 0:  # refresh clip ranges from the last `window` steps' rewards
                for i in range(2):
                    m = buf_t[i] >= t - window
                    if m.sum() >= 5:
                        lo[i] = float(dp_quantile(jax.random.fold_in(kt, 2 * i), buf[i], m, 0.05, eps_q, 0.0, 1.0))
                        hi[i] = float(dp_quantile(jax.random.fold_in(kt, 2 * i + 1), buf[i], m, 0.95, eps_q, 0.0, 1.0))
                        hi[i] = max(hi[i], lo[i] + 1e-3)
            q, d = np.zeros(2, np.float32), np.zeros(2, np.float32)
            for i in range(2):
                m = buf_t[i] >= t - window
                n = max(int(m.sum()), 1)
                q[i] = np.clip(buf[i][m], lo[i], hi[i]).sum() / n + math.sqrt(2 * math.log(t) / n)
                d[i] = (hi[i] - lo[i]) / n
            a = int(sample(kt, jnp.asarray(q), jnp.asarray(d), eps_sel))
        r = rewards[t, a]
        pulls[t], got[t] = a, r
        sums[a] += r
        counts[a] += 1
        if learner.startswith("window-"):
            slot = np.argmin(buf_t[a])
            buf[a, slot], buf_t[a, slot] = r, t
    best = rewards.max(1) if False else np.where(np.arange(T) < bandit.shift_at, rewards[:, 0], rewards[:, 1])
    return {"learner": learner, "cumulative_reward": float(got.sum()), "oracle_reward": float(best.sum()),
            "regret": float(best.sum() - got.sum()), "reward_curve": np.cumsum(got)[:: max(T // 50, 1)].tolist(),
            "privacy": report.to_dict() if report.releases else None}
