"""Statistics of privacy audits: empirical lower bounds on ε at a stated confidence.

An audit runs a mechanism on canaries and measures how well an attacker tells a canary's presence from its
absence. If the mechanism is (ε, δ)-DP, no attacker can do better than ε allows, so a measured success rate
that is too high for ε *rejects* ε. The lower bound is the largest ε rejected at confidence 1 − β: with
probability at least 1 − β over the audit's randomness, the mechanism is not (ε', δ)-DP for any ε' below it.
It is only a lower bound: a value below the reported ε says nothing (the attack may just be weak); a value
above it shows that the reported ε is wrong.

Two tests:

* **One run, many canaries** (Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run",
  NeurIPS 2023, Theorem 3.1 with its δ term). m canaries are each included independently with probability
  1/2; the attacker guesses r of them (r_+ "in" from the top of its scores, r_− "out" from the bottom) and v
  guesses are right. Under (ε, δ)-DP,
      P[V ≥ v] ≤ F(v) + 2mδ·max_{i=1..v} (F(v − i) − F(v)) / i,   F(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v].
  The canaries need not be independent of each other (the theorem covers any mechanism), so the canaries of
  several independent runs on disjoint canary sets pool into one audit. `one_run_audit` tries a grid of
  guess counts and divides β by the grid's size (Bonferroni), so the maximum over the grid keeps 1 − β.
* **Many runs, one canary** (Jagielski et al. 2020; Nasr et al. 2021): R_in runs with the canary, R_out
  without, a threshold test "in if score > t". With S = {score > t}, DP gives TPR ≤ e^ε·FPR + δ and
  TNR ≤ e^ε·FNR + δ, so ε ≥ log((1 − δ − FNR)/FPR) and ε ≥ log((1 − δ − FPR)/FNR). One-sided
  Clopper–Pearson bounds (each at β/2) make it a bound at confidence 1 − β. The threshold and the direction
  are chosen on one half of the runs and the bound is computed on the other half, so the choice costs no
  confidence. Needs independent runs (each run a fresh execution of the mechanism).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats

from jdp.validation import check_delta

_EPS_MAX = 60.0  # search ceiling for ε (e^60 ≈ 1e26: beyond any audit's resolution)
# The many-run test picks its threshold by the Clopper–Pearson bound on the selection half at this fraction of β:
# a stricter level there favours thresholds with more counts behind them, whose bound holds up on the other half
SELECTION_LEVEL = 0.05


def _check_confidence(confidence: float) -> float:
    c = float(confidence)
    if not 0.0 < c < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return c


def _check_delta0(delta: float) -> float:
    """δ in [0, 1) (0 allowed: pure DP)."""
    d = float(delta)
    if d == 0.0:
        return 0.0
    return check_delta(d)


# ---------------------------------------------------------------------------------------------------
# One run, many canaries.
def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of v correct guesses out of r (m canaries, each included w.p. 1/2) under the null hypothesis
    that the mechanism is (ε, δ)-DP: F(v) + 2mδ·max_i (F(v − i) − F(v))/i (Steinke, Nasr & Jagielski 2023)."""
    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    delta = _check_delta0(delta)
    if v == 0:
        return 1.0
    p = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of ε-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, p))  # F(v) = P[B ≥ v]
    if delta == 0.0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    # P[v − i ≤ B < v] = Σ_{j=1..i} P[B = v − j]: cumulative sums of the pmf below v
    below = np.cumsum(stats.binom.pmf(v - i, r, p))
    alpha = float(np.max(below / i))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def one_run_epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε that v correct guesses of r (m canaries) reject at `confidence` (0 when none is):
    sup{ε ≥ 0 : one_run_p_value(m, r, v, ε, δ) ≤ 1 − confidence}, by bisection (the p-value grows with ε)."""
    beta = 1.0 - _check_confidence(confidence)
    if one_run_p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, _EPS_MAX
    if one_run_p_value(m, r, v, hi, delta) <= beta:
        return hi
    for _ in range(60):  # to ~1e-16 of the bracket; lo always rejected (the reported bound is conservative)
        mid = 0.5 * (lo + hi)
        if one_run_p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """An empirical lower bound on ε at `confidence` and what it came from.

    method: "one-run" (Steinke et al.) or "many-run" (Clopper–Pearson) or "exact" (selection, no sampling).
    details: the counts behind the bound (guesses and correct guesses, or TP/FP counts and threshold)."""
    epsilon_lower_bound: float
    confidence: float
    delta: float
    method: str
    details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"epsilon_lower_bound": self.epsilon_lower_bound, "confidence": self.confidence,
                "delta": self.delta, "method": self.method, **self.details}


@dataclasses.dataclass(frozen=True)
class RoutineAudit:
    """An audit of one routine: the ε its report states beside the audited lower bound."""
    routine: str
    variant: str
    reported_epsilon: float
    result: AuditResult
    setting: dict = dataclasses.field(default_factory=dict)

    @property
    def epsilon_lower_bound(self) -> float:
        return self.result.epsilon_lower_bound

    @property
    def violated(self) -> bool:
        """True when the audit shows the reported ε is wrong (at the result's confidence)."""
        return self.result.epsilon_lower_bound > self.reported_epsilon

    def to_dict(self) -> dict:
        return {"routine": self.routine, "variant": self.variant, "reported_epsilon": self.reported_epsilon,
                "violated": self.violated, **self.result.to_dict(), "setting": dict(self.setting)}


def default_guess_grid(m: int) -> list[tuple[int, int]]:
    """(r_+, r_−) pairs tried by `one_run_audit`: r_+ = r_− = k and (k, 0) for k on a geometric ladder up to m/2."""
    ks = sorted({max(1, int(round(m * f))) for f in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)} - {0})
    ks = [k for k in ks if 2 * k <= m] or [max(1, m // 2)]
    return [(k, k) for k in ks] + [(k, 0) for k in ks]


def one_run_audit(scores, included, delta: float, confidence: float = 0.95,
                  guesses: list[tuple[int, int]] | None = None) -> AuditResult:
    """Steinke–Nasr–Jagielski lower bound from canary scores (higher = more likely included) and the true
    inclusion bits (each canary included independently w.p. 1/2, drawn by the auditor).

    For each (r_+, r_−) of `guesses` (default `default_guess_grid(m)`) the top r_+ scores are guessed "in" and
    the bottom r_− "out"; the bound of each pair is taken at confidence 1 − β/len(guesses) and the largest is
    returned (Bonferroni: the maximum holds at 1 − β). Ties are broken by position (independent of inclusion).
    """
    s = np.asarray(scores, np.float64).ravel()
    inc = np.asarray(included).ravel()
    if s.shape != inc.shape or s.size < 2:
        raise ValueError(f"scores and included must be 1-D of the same length >= 2, got {s.shape}, {inc.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    if not np.isin(inc, (0, 1)).all():
        raise ValueError("included must hold 0/1 (or booleans)")
    inc = inc.astype(bool)
    beta = 1.0 - _check_confidence(confidence)
    m = s.size
    grid = default_guess_grid(m) if guesses is None else [(int(a), int(b)) for a, b in guesses]
    if not grid or any(a < 0 or b < 0 or a + b == 0 or a + b > m for a, b in grid):
        raise ValueError(f"guesses must be (r_plus, r_minus) pairs with 0 < r_plus + r_minus <= m = {m}")
    level = 1.0 - beta / len(grid)
    order = np.argsort(-s, kind="stable")  # descending scores
    ranked = inc[order]
    best = (0.0, grid[0], 0)
    for r_plus, r_minus in grid:
        v = int(ranked[:r_plus].sum()) + int((~ranked[m - r_minus:]).sum() if r_minus else 0)
        eps = one_run_epsilon_lower_bound(m, r_plus + r_minus, v, delta, level)
        if eps > best[0] or (best[0] == 0.0 and (r_plus, r_minus) == grid[0]):
            best = (eps, (r_plus, r_minus), v)
    eps, (r_plus, r_minus), v = best
    return AuditResult(eps, float(confidence), float(delta), "one-run",
                       {"canaries": m, "included": int(inc.sum()), "guesses_in": r_plus, "guesses_out": r_minus,
                        "correct": v, "grid_size": len(grid)})


# ---------------------------------------------------------------------------------------------------
# Many runs, one canary.
def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided upper confidence bound (level 1 − α) for a binomial proportion with k successes of n."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, n > 0, got k={k}, n={n}")
    return 1.0 if k == n else float(stats.beta.ppf(1.0 - alpha, k + 1, n - k))


def clopper_pearson_lower(k: int, n: int, alpha: float) -> float:
    """One-sided lower confidence bound (level 1 − α) for a binomial proportion with k successes of n."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, n > 0, got k={k}, n={n}")
    return 0.0 if k == 0 else float(stats.beta.ppf(alpha, k, n - k + 1))


def threshold_epsilon(fp: int, n_out: int, fn: int, n_in: int, delta: float, alpha: float,
                      direction: str = "above") -> float:
    """ε lower bound of one threshold test with Clopper–Pearson bounds (each one-sided at level 1 − α/2).

    direction "above" (guess "in" when score > t): log((1 − δ − FNR⁺)/FPR⁺); "below" (the mirrored set):
    log((1 − δ − FPR⁺)/FNR⁺). 0 when the numerator is not positive."""
    fpr_up = clopper_pearson_upper(fp, n_out, alpha / 2)
    fnr_up = clopper_pearson_upper(fn, n_in, alpha / 2)
    num, den = (1.0 - delta - fnr_up, fpr_up) if direction == "above" else (1.0 - delta - fpr_up, fnr_up)
    if num <= 0 or den >= 1:
        return 0.0
    return max(0.0, math.log(num / den)) if den > 0 else _EPS_MAX


def _candidate_bounds(s_in: np.ndarray, s_out: np.ndarray, delta: float, alpha: float, max_candidates: int = 4096):
    """For candidate thresholds t (observed scores, at most `max_candidates` spread over their ranks): the
    Clopper–Pearson ε bound of both directions at level α, used to choose the test on the selection half."""
    t = np.unique(np.concatenate([s_in, s_out]))
    if t.size > max_candidates:
        t = t[np.unique(np.linspace(0, t.size - 1, max_candidates).round().astype(int))]
    s_in, s_out = np.sort(s_in), np.sort(s_out)
    fp = s_out.size - np.searchsorted(s_out, t, side="right")  # out-runs with score > t
    fn = np.searchsorted(s_in, t, side="right")                # in-runs with score <= t
    def upper(k, n):
        return np.where(k >= n, 1.0, stats.beta.ppf(1.0 - alpha / 2, k + 1, np.maximum(n - k, 1)))
    fpr_up, fnr_up = upper(fp, s_out.size), upper(fn, s_in.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        above = np.log(np.maximum(1 - delta - fnr_up, 1e-300) / fpr_up)
        below = np.log(np.maximum(1 - delta - fpr_up, 1e-300) / fnr_up)
    return t, above, below


def many_run_audit(scores_in, scores_out, delta: float, confidence: float = 0.95, *, seed: int) -> AuditResult:
    """Clopper–Pearson lower bound from independent runs with (`scores_in`) and without (`scores_out`) the
    canary; higher score = more likely "in".

    The runs are split at random (public `seed`) into a selection half, which picks the threshold and the
    direction whose bound is best there, and an evaluation half, on which one test is bounded at
    confidence 1 − β (each error rate one-sided at β/2)."""
    s_in = np.asarray(scores_in, np.float64).ravel()
    s_out = np.asarray(scores_out, np.float64).ravel()
    if s_in.size < 2 or s_out.size < 2:
        raise ValueError("need at least 2 runs with and 2 without the canary")
    if not (np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out))):
        raise ValueError("scores must be finite")
    beta = 1.0 - _check_confidence(confidence)
    delta = _check_delta0(delta)
    rng = np.random.default_rng(seed)
    p_in, p_out = rng.permutation(s_in.size), rng.permutation(s_out.size)
    sel_in, ev_in = s_in[p_in[: s_in.size // 2]], s_in[p_in[s_in.size // 2:]]
    sel_out, ev_out = s_out[p_out[: s_out.size // 2]], s_out[p_out[s_out.size // 2:]]
    t, above, below = _candidate_bounds(sel_in, sel_out, delta, SELECTION_LEVEL * beta)
    ia, ib = int(np.argmax(above)), int(np.argmax(below))
    direction, thr = ("above", t[ia]) if above[ia] >= below[ib] else ("below", t[ib])
    fp = int(np.sum(ev_out > thr))
    fn = int(np.sum(ev_in <= thr))
    eps = threshold_epsilon(fp, ev_out.size, fn, ev_in.size, delta, beta, direction)
    return AuditResult(eps, float(confidence), float(delta), "many-run",
                       {"runs_in": int(s_in.size), "runs_out": int(s_out.size), "threshold": float(thr),
                        "direction": direction, "false_positives": fp, "false_negatives": fn,
                        "evaluation_runs_in": int(ev_in.size), "evaluation_runs_out": int(ev_out.size)})


__all__ = ["AuditResult", "RoutineAudit", "clopper_pearson_lower", "clopper_pearson_upper", "default_guess_grid",
           "many_run_audit", "one_run_audit", "one_run_epsilon_lower_bound", "one_run_p_value", "threshold_epsilon"]
