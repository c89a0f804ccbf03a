"""Privacy tests of the selection mechanisms: exact-probability log-ratios on neighbouring inputs,
sampled-vs-exact chi-square, GEM score sensitivity, the RNMH counter-example, invalid inputs, events."""
import math

import jax
import numpy as np
import pytest
from scipy import stats

from jdp import selection as S
from jdp.accounting import compute_epsilon
from jdp.selection import exact
from jdp.selection import generalized_em as gem_mod

PRIVATE = sorted(S.PRIVATE_MECHANISMS)


def _neighbours(seed, n=150, k=6, monotone=False):
    """Random instances and neighbours with |q_a − q'_a| ≤ Δ_a (half at the extreme ±Δ_a)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, k)) * rng.uniform(0.1, 3.0, size=(n, 1))
    d = rng.uniform(0.05, 1.0, size=(n, k))
    u = rng.uniform(-1, 1, size=(n, k))
    u[: n // 2] = np.sign(u[: n // 2])
    if monotone:
        u = np.abs(u) * rng.choice([-1.0, 1.0], size=(n, 1))
    return q, d, q + u * d


def _max_log_ratio(p1, p2):
    assert np.all(p1 > 0) and np.all(p2 > 0)
    return float(np.abs(np.log(p1) - np.log(p2)).max())


@pytest.mark.parametrize("eps", [0.3, 2.0])
def test_exact_log_ratio_at_most_epsilon(eps):
    q, d, q2 = _neighbours(0)
    for name in PRIVATE:
        m = S.PRIVATE_MECHANISMS[name]
        lr = _max_log_ratio(m.probabilities(q, d, eps), m.probabilities(q2, d, eps))
        assert lr <= eps * (1 + 1e-6) + 1e-9, (name, lr, eps)
        if name == "krr":  # the argmax changes on some neighbours: the bound is attained
            assert lr == pytest.approx(eps, rel=1e-9)


def test_monotone_variants_and_that_the_check_has_teeth():
    eps = 1.0
    q, d, q2 = _neighbours(1, monotone=True)
    for name in ["rnm-exp", "rnm-gumbel", "rnm-laplace", "em", "pf"]:
        m = S.PRIVATE_MECHANISMS[name]
        lr = _max_log_ratio(m.probabilities(q, d, eps, monotone=True), m.probabilities(q2, d, eps, monotone=True))
        assert lr <= eps * (1 + 1e-6), (name, lr)
    # the monotone (half) noise on NON-monotone neighbours breaks ε: the same check detects it
    q, d, q2 = _neighbours(2)
    p1 = S.probabilities("em", q, d, eps, monotone=True)
    p2 = S.probabilities("em", q2, d, eps, monotone=True)
    assert _max_log_ratio(p1, p2) > 1.2 * eps


def test_other_parameters_keep_epsilon():
    q, d, q2 = _neighbours(3)
    eps = 1.0
    cases = [("rs-tnb", dict(eta=0.0, gamma=0.05)), ("rs-tnb", dict(eta=2.0, gamma=0.3)),
             ("rs-geometric", dict(gamma=0.01)), ("gem", dict(base="pf", beta=0.1)),
             ("mgem", dict(shift=-25.0)), ("combined-gem", dict(split=0.6, base="pf"))]
    for name, params in cases:
        m = S.PRIVATE_MECHANISMS[name]
        lr = _max_log_ratio(m.probabilities(q, d, eps, **params), m.probabilities(q2, d, eps, **params))
        assert lr <= eps * (1 + 1e-6), (name, params, lr)


@pytest.mark.parametrize("name", PRIVATE + ["rnmh-nonprivate"])
def test_sampled_frequencies_match_exact_probabilities(name):
    """Chi-square goodness of fit at a fixed seed, one shared instance (k = 5, 20 000 draws)."""
    q = np.array([0.3, -0.2, 0.9, 0.1, 0.4], np.float32)
    d = np.array([0.6, 0.25, 1.0, 0.4, 0.1], np.float32)
    n = 20_000
    p = S.probabilities(name, q, d, 1.5, allow_nonprivate=True)
    idx = S.select(name, jax.random.key(7), np.tile(q, (n, 1)), d, 1.5, allow_nonprivate=True)
    counts = np.bincount(np.asarray(idx), minlength=5)
    assert counts.sum() == n and counts.shape == (5,)
    _, pval = stats.chisquare(counts, n * p)
    assert pval > 1e-3, (name, counts / n, p)


def test_quadrature_against_closed_forms():
    rng = np.random.default_rng(4)
    q = rng.normal(size=(20, 7))
    b = rng.uniform(0.1, 2.0, size=(20, 1))
    # Gumbel-noise argmax is the softmax: checks the quadrature engine against a closed form
    gumbel = exact.noisy_max_probabilities(q, np.broadcast_to(b, q.shape), "gumbel")
    soft = np.exp(q / b) / np.exp(q / b).sum(-1, keepdims=True)
    np.testing.assert_allclose(gumbel, soft, rtol=1e-6, atol=1e-10)
    # two candidates, exponential noise with scales b1, b2: P[Y2 > Y1] in closed form (q2 >= q1)
    q1, q2, b1, b2 = 0.0, 0.7, 0.3, 1.1
    p = exact.noisy_max_probabilities(np.array([q1, q2]), np.array([b1, b2]), "exponential")
    p1 = b1 / (b1 + b2) * math.exp(-(q2 - q1) / b1)
    np.testing.assert_allclose(p, [p1, 1 - p1], rtol=1e-8)


@pytest.mark.parametrize("negative", [False, True])
def test_gem_normalised_score_moves_at_most_one(negative):
    q, d, q2 = _neighbours(5, n=400, k=12)
    for eps in (0.1, 1.0):
        t = gem_mod.default_shift(12, eps, 0.5, negative)
        s1, s2 = gem_mod.gem_scores_np(q, d, t), gem_mod.gem_scores_np(q2, d, t)
        assert np.abs(s1 - s2).max() <= 1 + 1e-12
        assert np.all(s1 <= 0) and np.all(s1.max(-1) == 0)
        # the jitted float32 versions (dense and hull-chain frontier) agree with the float64 reference
        dense = np.asarray(gem_mod.gem_scores(q.astype(np.float32), d.astype(np.float32), t))
        front, overflow = gem_mod.gem_scores_frontier(q.astype(np.float32), d.astype(np.float32), t, 12)
        front = np.where(np.asarray(overflow)[:, None], s1, np.asarray(front))
        np.testing.assert_allclose(dense, s1, rtol=1e-4, atol=1e-4 * abs(t))
        np.testing.assert_allclose(front, s1, rtol=1e-4, atol=1e-4 * abs(t))


def test_rnmh_privacy_loss_is_unbounded():
    """Two candidates: Δ_a → 0, Δ_b = 1, q_a − q_b = 0.5; the neighbour raises q_b by Δ_b = 1."""
    eps = 1.0
    losses = []
    for da in (0.1, 0.01, 0.002):
        d = np.array([da, 1.0])
        p = S.probabilities("rnmh-nonprivate", np.array([0.5, 0.0]), d, eps, allow_nonprivate=True)
        p2 = S.probabilities("rnmh-nonprivate", np.array([0.5, 1.0]), d, eps, allow_nonprivate=True)
        losses.append(math.log(p[0] / p2[0]))
        # P[a] on D is at least 1 − e^{−ε·0.5/2}; on D' at most e^{−0.5ε/(2Δ_a)}
        assert p[0] >= 1 - math.exp(-eps * 0.5 / 2) - 1e-9
        assert p2[0] <= math.exp(-0.5 * eps / (2 * da)) * (1 + 1e-6)
    assert losses[0] > eps and losses[1] > 10 * eps and losses[2] > 100 * eps
    assert losses[0] < losses[1] < losses[2]
    # a private mechanism on the same pair stays within ε
    for name in ("gem", "mgem", "rs-geometric", "rnm-exp"):
        d = np.array([0.002, 1.0])
        p = S.probabilities(name, np.array([0.5, 0.0]), d, eps)
        p2 = S.probabilities(name, np.array([0.5, 1.0]), d, eps)
        assert _max_log_ratio(p, p2) <= eps * (1 + 1e-6)


def test_rnmh_is_not_in_the_private_registry():
    assert "rnmh-nonprivate" not in S.PRIVATE_MECHANISMS
    assert not any("rnmh" in name for name in S.PRIVATE_MECHANISMS)
    with pytest.raises(ValueError, match="not differentially private"):
        S.select("rnmh-nonprivate", jax.random.key(0), np.zeros((2, 3)), np.ones(3), 1.0)
    with pytest.raises(ValueError, match="NOT differentially private"):
        S.NONPRIVATE_REFERENCES["rnmh-nonprivate"].dp_event(1.0)


def _event_epsilon(event):
    return math.log((1 - event.noise_parameter / 2) / (event.noise_parameter / 2))


def test_events_and_budget_splits_add_up():
    slack = 1 + S.registry.LOSS_SLACK
    for name in PRIVATE:
        m = S.PRIVATE_MECHANISMS[name]
        if name == "uniform":
            continue
        report = S.privacy_report(name, 0.7)
        want = 0.7 * (1 if name == "krr" else 0.5 + 0.5 * slack if name == "combined-gem" else slack)
        assert report.pure_epsilon() == pytest.approx(want, rel=1e-12)
        assert compute_epsilon(m.dp_event(0.7), 1e-6) == pytest.approx(want, abs=2e-3)
    report = S.privacy_report("combined-gem", 1.0, split=0.3, count=3)
    assert len(report.releases) == 2 and report.pure_epsilon() == pytest.approx(3 * (0.3 + 0.7 * slack), rel=1e-12)
    assert report.epsilon() <= 3.0 * slack + 1e-3
    eps1, eps2 = (_event_epsilon(r.event) for r in report.releases)
    assert eps1 == pytest.approx(0.3, rel=1e-12) and eps2 == pytest.approx(0.7 * slack, rel=1e-12)
    assert S.privacy_report("uniform", 1.0).epsilon() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon=-1.0), "epsilon"), (dict(epsilon=float("nan")), "epsilon"),
    (dict(epsilon=float("inf")), "epsilon"),
    (dict(scores=np.array([[1.0, np.nan, 0.0]])), "scores"), (dict(scores=np.array([[1.0, np.inf, 0.0]])), "scores"),
    (dict(scores=np.zeros((2, 0))), "scores"),
    (dict(sens=np.array([1.0, 0.0, 1.0])), "sensitivities"), (dict(sens=np.array([1.0, -1.0, 1.0])), "sensitivities"),
    (dict(sens=np.array([1.0, np.nan, 1.0])), "sensitivities"), (dict(sens=np.ones(4)), "sensitivities"),
    (dict(name="nope"), "unknown mechanism"), (dict(params=dict(beta=1.5)), "beta"),
    (dict(params=dict(beta=0.0)), "beta"), (dict(params=dict(bogus=1)), "bogus"),
    (dict(name="rs-geometric", params=dict(gamma=0.0)), "gamma"),
    (dict(name="rs-tnb", params=dict(eta=-0.5)), "eta"),
    (dict(name="combined-gem", params=dict(split=1.0)), "split"),
    (dict(params=dict(base="xx")), "base"),
])
def test_invalid_inputs_raise(bad, match):
    name = bad.get("name", "gem")
    scores = bad.get("scores", np.zeros((2, 3)))
    sens = bad.get("sens", np.ones(3))
    eps = bad.get("epsilon", 1.0)
    with pytest.raises(ValueError, match=match):
        S.select(name, jax.random.key(0), scores, sens, eps, **bad.get("params", {}))
    if name in S.PRIVATE_MECHANISMS:
        with pytest.raises(ValueError, match=match):
            S.probabilities(name, scores, sens, eps, **bad.get("params", {}))


def test_recorded_epsilon_includes_the_float64_rounding_bound():
    """Issue #69 item 6: float64 rounding of the shifted scores can enlarge a sensitivity Δ to Δ + 2η with
    2η/Δ ≤ 2⁻¹² on every row `check_range` accepts, so a selection at ε guarantees ε·(1 + 2⁻¹²), not ε.
    Every score-comparing mechanism records that bound in its event and every report shows it; kRR and
    the RR bit of combined GEM read only a function of the scores and keep ε."""
    from jdp.selection.registry import LOSS_SLACK, _UNIT_ROUNDOFF, check_range
    assert LOSS_SLACK == 2.0 ** -12
    for name in PRIVATE:
        m = S.PRIVATE_MECHANISMS[name]
        if m.privacy == "none":
            assert S.privacy_report(name, 1.0).epsilon() == pytest.approx(0.0, abs=1e-6)
            continue
        rounded = m.resolution is not None
        assert m.guaranteed_epsilon(1.3) == (1.3 * (1 + LOSS_SLACK) if rounded else 1.3)
        events = m.dp_event(1.3).events if m.privacy == "split" else [m.dp_event(1.3)]
        assert _event_epsilon(events[-1]) == pytest.approx(m.guaranteed_epsilon(1.3 * (0.5 if m.privacy == "split"
                                                                                        else 1.0)), rel=1e-12)
        if rounded:  # above ε by the slack, in the event, the pure total and the PLD total
            report = S.privacy_report(name, 1.0, count=5)
            assert report.pure_epsilon() > 5.0 and report.epsilon() > 5.0
            assert _event_epsilon(events[-1]) > 1.3 * (0.5 if m.privacy == "split" else 1.0) * (1 + LOSS_SLACK / 2)
    # the slack recorded is the one `check_range` enforces: a row just inside its limit is accepted, just
    # outside rejected (ε = 1, Δ = 1, the EM: the limit is a range of LOSS_SLACK / (4u))
    em = S.PRIVATE_MECHANISMS["em"]
    limit = LOSS_SLACK / (4 * _UNIT_ROUNDOFF)
    check_range(em, np.array([0.0, -limit * (1 - 1e-9)]), np.ones(2), 1.0, {})
    with pytest.raises(ValueError, match="scores"):
        check_range(em, np.array([0.0, -limit * (1 + 1e-9)]), np.ones(2), 1.0, {})
    # selection events recorded by select_configuration (and so tune_private) carry the bound too
    from jdp.accounting import PrivacyReport
    report = PrivacyReport(1e-6)
    S.select_configuration(jax.random.key(0), np.array([0.0, -1.0, -2.0]), 1.0, 0.5, report)
    assert report.pure_epsilon() == pytest.approx(0.5 * (1 + LOSS_SLACK), rel=1e-12)
    # and under replace-special (issue #69 item 4): one EM selection at ε = 1 reports at least 1, five at least 5
    for count in (1, 5):
        assert S.privacy_report("em", 1.0, count=count, relation="replace_special").epsilon() >= count
