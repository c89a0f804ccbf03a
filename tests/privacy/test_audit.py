"""Privacy audits (`jdp.audit`): the statistics against independent computations, (a) every audited routine's
lower bound stays at or below its reported ε, (b) every deliberately broken variant is caught (its lower bound
exceeds the reported ε): an audit that cannot fail is not an audit. Seeds are fixed, so each assertion is a
deterministic check of one audit at the stated confidence."""
import math

import jax
import numpy as np
import pytest
from scipy import stats

from jdp import selection as S
from jdp.altmin import AltMinConfig
from jdp.audit import bounds
from jdp.audit.altmin import audit_altmin
from jdp.audit.dp_sgd import DPSGDAuditConfig, audit_dp_sgd, old_engine_available
from jdp.audit.selection import exact_audit, sampled_audit

CFG = DPSGDAuditConfig(epsilon=2.0, delta=1e-5, steps=2, sampling_rate=1.0)


# ---------------------------------------------------------------------------------------------------
# Statistics.
def _p_value_reference(m, r, v, eps, delta):
    """The one-run p-value written out term by term with exact binomial coefficients (no scipy)."""
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, j) * p ** j * (1 - p) ** (r - j) for j in range(r + 1)]
    tail = sum(pmf[v:])
    alpha, acc = 0.0, 0.0
    for i in range(1, v + 1):
        acc += pmf[v - i]
        alpha = max(alpha, acc / i)
    return min(1.0, tail + 2 * m * delta * alpha)


@pytest.mark.parametrize("m, r, v, eps, delta", [(100, 20, 18, 1.0, 1e-5), (1000, 60, 50, 2.0, 1e-4),
                                                  (50, 50, 30, 0.3, 0.0), (400, 100, 100, 3.0, 1e-6)])
def test_one_run_p_value_matches_a_term_by_term_reference(m, r, v, eps, delta):
    assert bounds.one_run_p_value(m, r, v, eps, delta) == pytest.approx(_p_value_reference(m, r, v, eps, delta),
                                                                         rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("r", [10, 50, 200, 1000])
def test_one_run_bound_on_perfect_guesses_has_its_closed_form_and_grows_with_r(r):
    """δ = 0, v = r correct: P[Bin(r, p) ≥ r] = p^r ≤ β  ⇔  ε ≤ logit(β^{1/r})."""
    beta = 0.05
    p = beta ** (1.0 / r)
    expected = math.log(p / (1 - p))
    got = bounds.one_run_epsilon_lower_bound(2 * r, r, r, 0.0, confidence=1 - beta)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got <= expected * (1 + 1e-12)  # bisection keeps the rejected side (up to scipy's rounding)
    if r > 10:
        assert got > bounds.one_run_epsilon_lower_bound(r, r // 2, r // 2, 0.0, 1 - beta)
    # δ > 0 only weakens it; fewer correct guesses weaken it; a higher confidence weakens it
    assert bounds.one_run_epsilon_lower_bound(2 * r, r, r, 1e-5, 1 - beta) <= got
    assert bounds.one_run_epsilon_lower_bound(2 * r, r, int(0.9 * r), 0.0, 1 - beta) < got
    assert bounds.one_run_epsilon_lower_bound(2 * r, r, r, 0.0, 0.99) < got


def test_one_run_bound_is_valid_on_a_mechanism_of_known_epsilon():
    """Randomized response at ε = 1 (pure DP, the worst case for the guessing game): over 40 audits of 2,000
    canaries, the bound at 95% confidence exceeds ε at most a handful of times, and it is informative (mean > 0.5)."""
    rng = np.random.default_rng(0)
    eps, lbs = 1.0, []
    for _ in range(40):
        inc = rng.random(2000) < 0.5
        flip = rng.random(2000) < 1 / (1 + math.exp(eps))
        lbs.append(bounds.one_run_audit(np.where(flip, ~inc, inc).astype(float) + 1e-9 * rng.random(2000), inc,
                                        0.0).epsilon_lower_bound)
    lbs = np.array(lbs)
    assert np.sum(lbs > eps) <= 4 and lbs.mean() > 0.5


def test_one_run_audit_counts_guesses_and_pays_for_the_grid():
    rng = np.random.default_rng(1)
    inc = rng.random(1000) < 0.5
    perfect = bounds.one_run_audit(inc.astype(float), inc, 0.0)
    det = perfect.details
    assert det["correct"] == det["guesses_in"] + det["guesses_out"] and det["canaries"] == 1000
    # with one (r+, r−) pair there is no Bonferroni factor: a larger bound for the same guesses
    one = bounds.one_run_audit(inc.astype(float), inc, 0.0, guesses=[(det["guesses_in"], det["guesses_out"])])
    assert one.epsilon_lower_bound > perfect.epsilon_lower_bound
    noise = bounds.one_run_audit(rng.normal(size=1000), inc, 1e-5)
    assert noise.epsilon_lower_bound < 0.3
    with pytest.raises(ValueError, match="included"):
        bounds.one_run_audit(np.zeros(4), np.array([0, 1, 2, 1]), 1e-5)
    with pytest.raises(ValueError, match="confidence"):
        bounds.one_run_audit(np.zeros(4), np.array([0, 1, 0, 1]), 1e-5, confidence=1.0)


def test_clopper_pearson_matches_scipy_exact_interval():
    for k, n in [(0, 50), (3, 50), (25, 50), (50, 50), (7, 10_000)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
        assert bounds.clopper_pearson_lower(k, n, 0.05) == pytest.approx(ci.low, abs=1e-12)
        assert bounds.clopper_pearson_upper(k, n, 0.05) == pytest.approx(ci.high, abs=1e-12)


def test_many_run_bound_is_valid_and_has_power_on_a_gaussian_mechanism():
    """Gaussian mechanism N(1, σ²) vs N(0, σ²) with σ for ε = 2 (δ = 1e-5, dp_accounting): the bound stays
    below 2 over 10 seeds; with σ/2 (true ε ≈ 4.4) it exceeds 2 on most of them."""
    from jdp.accounting import calibrate, gaussian_event
    sigma = calibrate(gaussian_event, 2.0, 1e-5)
    rng = np.random.default_rng(2)
    n = 100_000
    honest = [bounds.many_run_audit(1 + sigma * rng.normal(size=n), sigma * rng.normal(size=n), 1e-5,
                                    seed=s).epsilon_lower_bound for s in range(10)]
    broken = [bounds.many_run_audit(1 + sigma / 2 * rng.normal(size=n), sigma / 2 * rng.normal(size=n), 1e-5,
                                    seed=s).epsilon_lower_bound for s in range(10)]
    assert max(honest) <= 2.0 and min(honest) > 0.5
    assert sum(b > 2.0 for b in broken) >= 8
    same = bounds.many_run_audit(rng.normal(size=5000), rng.normal(size=5000), 1e-5, seed=0)
    assert same.epsilon_lower_bound < 0.2


# ---------------------------------------------------------------------------------------------------
# DP-SGD.
@pytest.mark.parametrize("canary", ["gradient", "input"])
def test_dp_sgd_one_run_audit_stays_below_reported_epsilon(canary):
    a = audit_dp_sgd(jax.random.key(1), CFG, seed=0, canary=canary, canaries=1000)
    assert a.reported_epsilon == pytest.approx(2.0, abs=1e-3)
    assert 0.0 <= a.epsilon_lower_bound <= a.reported_epsilon and not a.violated


@pytest.mark.slow
def test_dp_sgd_many_run_gradient_canary_audit_stays_below_reported_epsilon():
    a = audit_dp_sgd(jax.random.key(2), CFG, seed=0, canary="gradient", mode="many-run", runs=20_000)
    assert 0.3 < a.epsilon_lower_bound <= a.reported_epsilon


@pytest.mark.slow
@pytest.mark.parametrize("canary", ["gradient", "input"])
def test_dp_sgd_audit_catches_clipping_turned_off(canary):
    a = audit_dp_sgd(jax.random.key(1), CFG, seed=0, canary=canary, canaries=1000, variant="no-clip")
    assert a.violated and a.epsilon_lower_bound > 1.5 * a.reported_epsilon


@pytest.mark.slow
def test_dp_sgd_audit_catches_half_the_noise():
    """σ/2 while the report states ε at σ (true ε ≈ 4.4 at ε = 2): 150,000 runs with and without one gradient
    canary."""
    a = audit_dp_sgd(jax.random.key(3), CFG, seed=0, canary="gradient", mode="many-run", runs=150_000, variant="half-noise")
    assert a.violated, a.to_dict()


@pytest.mark.slow
def test_dp_sgd_audit_of_the_crafted_cancellation_canary():
    """The crafted example (float32 cancellation of a ghost norm) against the engine: with its floating-point
    bound the audit stays below ε; with the old norm computation (`_FP_BOUND = False`) it is caught."""
    if not old_engine_available():
        pytest.skip("jdp.clipping.norms._FP_BOUND does not exist yet: the engine without the floating-point bound "
                    "cannot be selected (and the default engine is the old one)")
    honest = audit_dp_sgd(jax.random.key(4), CFG, seed=0, canary="fp-cancel", canaries=4096)
    assert not honest.violated and honest.epsilon_lower_bound <= honest.reported_epsilon
    old = audit_dp_sgd(jax.random.key(4), CFG, seed=0, canary="fp-cancel", canaries=4096, variant="old-engine")
    assert old.violated and old.epsilon_lower_bound > 1.5 * old.reported_epsilon, old.to_dict()
    from jdp.clipping import norms
    assert norms._FP_BOUND is True  # restored


def test_dp_sgd_audit_rejects_bad_options():
    with pytest.raises(ValueError, match="variant"):
        audit_dp_sgd(jax.random.key(0), CFG, seed=0, variant="nope")
    with pytest.raises(ValueError, match="many-run"):
        audit_dp_sgd(jax.random.key(0), CFG, seed=0, canary="input", mode="many-run")
    with pytest.raises(ValueError, match="canary"):
        audit_dp_sgd(jax.random.key(0), CFG, seed=0, canary="nope")


# ---------------------------------------------------------------------------------------------------
# Selection.
@pytest.mark.parametrize("name", sorted(S.PRIVATE_MECHANISMS))
def test_selection_exact_audit_stays_below_reported_epsilon(name):
    for eps in (0.5, 2.0):
        a = exact_audit(name, eps)
        assert a.epsilon_lower_bound <= a.reported_epsilon, a.to_dict()
        if name == "krr":  # the argmax changes on some neighbour: ε is attained
            assert a.epsilon_lower_bound == pytest.approx(eps, abs=1e-7)
        if name in ("rnm-exp", "pf"):  # attained on the tied / one-leader instances
            assert a.epsilon_lower_bound > 0.99 * eps
    if name in ("em", "pf", "rnm-laplace"):
        mono = exact_audit(name, 1.0, monotone=True)
        assert mono.setting["relation"] == "monotone" and not mono.violated


@pytest.mark.parametrize("name, kwargs", [("rnmh-nonprivate", {}), ("em", {"variant": "half-noise"}),
                                          ("gem", {"variant": "half-noise"}),
                                          ("pf", {"variant": "monotone-misdeclared"}),
                                          ("rnm-gumbel", {"variant": "monotone-misdeclared"})])
def test_selection_exact_audit_catches_broken_variants(name, kwargs):
    a = exact_audit(name, 1.0, **kwargs)
    assert a.violated and a.epsilon_lower_bound > 1.2 * a.reported_epsilon, a.to_dict()


def test_selection_sampled_audit_of_the_sampler():
    for name in ("krr", "pf"):
        a = sampled_audit(name, 1.0, jax.random.key(5), draws=100_000)
        assert 0.5 < a.epsilon_lower_bound <= a.reported_epsilon, a.to_dict()
    for name, kwargs in [("rnmh-nonprivate", {}), ("em", {"variant": "half-noise"})]:
        a = sampled_audit(name, 1.0, jax.random.key(6), draws=100_000, **kwargs)
        assert a.violated, a.to_dict()


# ---------------------------------------------------------------------------------------------------
# altmin.
ALT = dict(epsilon=2.0, budget=8, show_progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ada-dpals", "ada-dpsgd"])
def test_altmin_canary_audit_stays_below_reported_epsilon(method):
    a = audit_altmin(AltMinConfig(method=method, **ALT), canaries=200, seed=0)
    assert a.reported_epsilon == pytest.approx(2.0, abs=1e-3)
    assert 0.0 <= a.epsilon_lower_bound <= a.reported_epsilon, a.to_dict()


@pytest.mark.slow
def test_altmin_canary_audit_catches_a_fit_without_noise():
    a = audit_altmin(AltMinConfig(method="ada-dpals", **ALT), canaries=400, variant="no-noise", seed=0)
    assert a.violated and a.epsilon_lower_bound > 1.5 * a.reported_epsilon, a.to_dict()
