"""Synthetic selection scenarios and noise-free utility (MSE) curves from exact probabilities.

The paper's exact distributions were not recoverable; these generators are our design, built so the
qualitative properties the paper describes hold (documented per generator). Sensitivities come from a
public per-candidate model, never from the drawn scores: for the smooth and copula families the score
model is N(μ_a, σ_a), Δ_a = 2·z₀.₉₅·σ_a is the spread between its 5% and 95% quantiles and the drawn
score is clipped to that range (so |q_a − q'_a| ≤ Δ_a for any two draws); the bimodal family is
described in `bimodal`.

Error of a mechanism on one problem = E[(q* − q_â)²] = Σ_a P[â = a](q* − q_a)², computed exactly from
the output probabilities; curves average it over independent problems (trials).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from scipy import stats
from tqdm.auto import tqdm

from jdp.selection.registry import get_mechanism

Z95 = float(stats.norm.ppf(0.95))
DEFAULT_EPSILONS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 16.0)
DEFAULT_MECHANISMS = ("uniform", "krr", "rnm-exp", "em", "gem", "mgem", "rs-geometric", "combined-gem",
                      "rnmh-nonprivate")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A named generator: draw(rng, trials, k) -> (scores [T, k], sensitivities [T, k])."""
    name: str
    description: str
    draw: Callable[[np.random.Generator, int, int], tuple[np.ndarray, np.ndarray]]


def _from_model(rng, mu, sigma):
    """Scores drawn from N(μ, σ) clipped to the 5%-95% range; Δ = that range's width."""
    half = Z95 * sigma
    q = np.clip(mu + sigma * rng.normal(size=mu.shape), mu - half, mu + half)
    return q, 2.0 * half


def bimodal(correlation: str, high_delta: float = 1.0, low_delta: float = 0.05,
            score_noise: float = 0.01) -> Scenario:
    """Scenarios 1-3: half the candidates score high (μ = 1), half low (μ = 0); sensitivities are high
    (Δ = 1) or low (Δ = 0.05) for the high scorers ("positive"), the low scorers ("negative") or a random
    half ("none"). Here Δ_a is the 5%-95% spread of the candidate's per-user score model, and the
    aggregate score varies little between problems: q_a = μ_a + N(0, 0.01²), clipped to μ_a ± Δ_a/2,
    so "positive" and "negative" are mirror images with the same score distribution."""
    def draw(rng, trials, k):
        high = np.arange(k) < k // 2
        mu = np.broadcast_to(np.where(high, 1.0, 0.0), (trials, k))
        if correlation == "positive":
            sens_high = np.broadcast_to(high, (trials, k))
        elif correlation == "negative":
            sens_high = np.broadcast_to(~high, (trials, k))
        else:
            sens_high = rng.permuted(np.broadcast_to(high, (trials, k)), axis=-1)
        delta = np.where(sens_high, high_delta, low_delta)
        q = np.clip(mu + score_noise * rng.normal(size=(trials, k)), mu - delta / 2, mu + delta / 2)
        return q, delta
    return Scenario(f"bimodal-{correlation}", bimodal.__doc__.split("\n")[0], draw)


def smooth(correlation: str) -> Scenario:
    """Scenarios 4-6: μ_a ~ U(0, 1) per trial; σ_a = 0.01 + 0.2·u_a·(0.8 + 0.4·U(0,1)) with u = μ
    ("positive"), 1 − μ ("negative") or an independent U(0, 1) ("none")."""
    def draw(rng, trials, k):
        mu = rng.uniform(size=(trials, k))
        u = {"positive": mu, "negative": 1.0 - mu}.get(correlation)
        if u is None:
            u = rng.uniform(size=(trials, k))
        sigma = 0.01 + 0.2 * u * (0.8 + 0.4 * rng.uniform(size=(trials, k)))
        return _from_model(rng, mu, sigma)
    return Scenario(f"smooth-{correlation}", smooth.__doc__.split("\n")[0], draw)


def copula(rho: float) -> Scenario:
    """Increasing-correlation family: Gaussian copula with correlation ρ between the score level
    μ_a = Φ(z₁) and the noise level σ_a = 0.01 + 0.2·Φ(z₂)."""
    def draw(rng, trials, k):
        z1 = rng.normal(size=(trials, k))
        z2 = rho * z1 + np.sqrt(1 - rho**2) * rng.normal(size=(trials, k))
        return _from_model(rng, stats.norm.cdf(z1), 0.01 + 0.2 * stats.norm.cdf(z2))
    return Scenario(f"copula-rho{rho:+.1f}", copula.__doc__.split("\n")[0], draw)


def polarised(strength: str = "strong") -> Scenario:
    """Scenarios 7-8: half the problems (users) have positive, half negative correlation — bimodal
    ("strong") or smooth ("weak") generators."""
    gen = bimodal if strength == "strong" else smooth
    pos, neg = gen("positive"), gen("negative")

    def draw(rng, trials, k):
        qa, da = pos.draw(rng, trials - trials // 2, k)
        qb, db = neg.draw(rng, trials // 2, k)
        return np.concatenate([qa, qb]), np.concatenate([da, db])
    return Scenario(f"polarised-{strength}", polarised.__doc__.split("\n")[0], draw)


def all_scenarios() -> list[Scenario]:
    """The scenarios of the experiment, in report order."""
    out = [bimodal(c) for c in ("positive", "negative", "none")] + [smooth(c) for c in ("positive", "negative", "none")]
    out += [copula(r) for r in (-0.9, -0.5, 0.0, 0.5, 0.9)]
    return out + [polarised("strong"), polarised("weak")]


def expected_squared_error(probabilities: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Σ_a P[a](max q − q_a)² per problem, [...]."""
    q = np.asarray(scores, np.float64)
    return np.sum(probabilities * (q.max(-1, keepdims=True) - q) ** 2, axis=-1)


def mse_curves(scores: np.ndarray, sensitivities: np.ndarray, mechanisms=DEFAULT_MECHANISMS,
               epsilons=DEFAULT_EPSILONS, chunk: int = 8, params: dict | None = None,
               progress: bool = False) -> dict:
    """{mechanism: [mean MSE at each ε]} over the problems (rows) of scores/sensitivities [T, k]
    (`progress`: a bar over the mechanism × ε cells)."""
    params = params or {}
    out = {}
    bar = tqdm(total=len(mechanisms) * len(epsilons), desc="MSE curves", unit="cell", disable=not progress)
    for name in mechanisms:
        mech = get_mechanism(name, allow_nonprivate=True)
        curve = []
        for eps in epsilons:
            bar.set_postfix_str(f"{name} eps={eps:g}")
            errs = [expected_squared_error(
                mech.probabilities(scores[i:i + chunk], sensitivities[i:i + chunk], eps, **params.get(name, {})),
                scores[i:i + chunk]) for i in range(0, len(scores), chunk)]
            curve.append(float(np.concatenate(errs).mean()))
            bar.update()
        out[name] = curve
    bar.close()
    return out
