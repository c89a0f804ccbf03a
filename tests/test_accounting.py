import math

import dp_accounting
import pytest

from jdp import accounting as acc
from jdp.validation import check_epsilon


def _reference_dpals_event(sigma, steps, sigma_c, k=100):
    """Event structure of the DPALS reference (spec §8): centering charged as 2×G(σ_c), counts
    G(σ_c/√k), each step Composed[G(σ/√k) for A, G(σ/√k) for b]."""
    g = dp_accounting.GaussianDpEvent
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(g(sigma_c), 2),
        g(sigma_c / math.sqrt(k)),
        dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([g(sigma / math.sqrt(k))] * 2), steps),
    ])


@pytest.mark.parametrize("eps,steps,sigma_c,expected", [(1, 2, 200, 82.65), (5, 3, 40, 24.04), (20, 4, 10, 9.05)])
def test_reference_noise_multipliers_regression(eps, steps, sigma_c, expected):
    sigma = acc.calibrate(lambda s: _reference_dpals_event(s, steps, sigma_c), eps, 1e-5, bracket=(1e-2, 1e4),
                          orders=acc.REFERENCE_RDP_ORDERS)
    assert abs(sigma / expected - 1) < 0.01
    # calibrated value spends the target ε and a 2% smaller noise overspends it
    assert acc.compute_epsilon(_reference_dpals_event(sigma, steps, sigma_c), 1e-5,
                               orders=acc.REFERENCE_RDP_ORDERS) == pytest.approx(eps, rel=1e-3)
    assert acc.compute_epsilon(_reference_dpals_event(0.98 * sigma, steps, sigma_c), 1e-5,
                               orders=acc.REFERENCE_RDP_ORDERS) > eps


def test_correct_centering_costs_more_than_reference_charges():
    # spec §8: with centering charged at its true sensitivity (sum: k·r_max, count: k) the ML10M ε=1
    # configuration spends ≈ 2.46.
    k, sigma_c, sigma, rmax = 100, 200.0, 82.65, 5.0
    g = dp_accounting.GaussianDpEvent
    # numerator: noise std r_max·√k·σ_c over sensitivity k·r_max; denominator: std σ_c over sensitivity k
    ev = dp_accounting.ComposedDpEvent([
        g(rmax * math.sqrt(k) * sigma_c / (k * rmax)), g(sigma_c / k), g(sigma_c / math.sqrt(k)),
        dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([g(sigma / math.sqrt(k))] * 2), 2)])
    assert acc.compute_epsilon(ev, 1e-5, orders=acc.REFERENCE_RDP_ORDERS) == pytest.approx(2.46, abs=0.03)


def test_report_composes_and_lists_releases():
    r = acc.PrivacyReport(1e-5)
    r.add_gaussian("a", sensitivity=2.0, noise_std=20.0)
    r.add_gaussian("b", sensitivity=1.0, noise_std=10.0, count=3)
    direct = acc.compute_epsilon(dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(10.0), dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(10.0), 3)]), 1e-5)
    assert r.epsilon() == pytest.approx(direct)
    d = r.to_dict()
    assert [x["name"] for x in d["releases"]] == ["a", "b"] and d["releases"][1]["count"] == 3
    assert d["epsilon"] == pytest.approx(direct) and "total epsilon" in str(r)


def test_pure_dp_events_compose_tightly_and_never_below_single():
    r = acc.PrivacyReport(1e-6).add("sel", acc.pure_dp_event(0.5), count=3)
    assert r.pure_epsilon() == pytest.approx(1.5)
    assert 1.0 < r.epsilon() <= 1.5 + 1e-3   # PLD composition of three 0.5-DP releases
    single = acc.PrivacyReport(1e-6).add("sel", acc.pure_dp_event(0.5))
    assert single.epsilon() == pytest.approx(0.5, abs=1e-3)


def test_pld_and_rdp_agree_roughly_for_gaussian():
    ev = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(5.0), 10)
    e_rdp, e_pld = acc.compute_epsilon(ev, 1e-5, "rdp"), acc.compute_epsilon(ev, 1e-5, "pld")
    assert e_pld <= e_rdp and e_pld > 0.7 * e_rdp


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "x"])
def test_invalid_epsilon(bad):
    with pytest.raises(ValueError, match="epsilon"):
        check_epsilon(bad)


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan")])
def test_invalid_delta(bad):
    with pytest.raises(ValueError, match="delta"):
        acc.PrivacyReport(bad)


def test_calibrate_unreachable_budget_raises():
    fixed = dp_accounting.GaussianDpEvent(0.5)  # alone spends far more than ε = 0.1
    with pytest.raises(ValueError, match="cannot reach"):
        acc.calibrate(lambda s: dp_accounting.ComposedDpEvent([fixed, dp_accounting.GaussianDpEvent(s)]), 0.1, 1e-5)


def test_rdp_orders_that_fail_to_converge_are_summarised_not_logged_per_order(caplog):
    import logging
    import warnings

    from jdp.clipping import calibrate_noise_multiplier
    # the absl logger's own level decides whether dp_accounting emits at all (other tests may raise it)
    with caplog.at_level(logging.WARNING, logger="absl"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sigma = calibrate_noise_multiplier(2.0, 1e-5, 0.25, 3)   # dp_accounting logs ~100 lines here
    assert 1.0 < sigma < 3.0
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]
    assert any("excluded some orders" in str(w.message) for w in caught)


def test_equivalent_spellings_share_one_accounting_and_fresh_values(monkeypatch):
    # SelfComposed(SelfComposed(e, 4), 3), a one-event composition and nested compositions are the same
    # mechanism as their flat spelling: one accountant run serves all, with the value a fresh run gives
    g, sc = dp_accounting.GaussianDpEvent, dp_accounting.SelfComposedDpEvent
    step = dp_accounting.PoissonSampledDpEvent(0.01, g(1.1))
    flat = dp_accounting.ComposedDpEvent([g(7.0), sc(step, 12)])
    nested = dp_accounting.ComposedDpEvent([dp_accounting.ComposedDpEvent([g(7.0)]),
                                            sc(sc(dp_accounting.ComposedDpEvent([step]), 4), 3)])
    monkeypatch.setattr(acc.events, "_ACCOUNTED", {})
    runs = []
    account = acc.events._account
    monkeypatch.setattr(acc.events, "_account", lambda *a: runs.append(a[0]) or account(*a))
    eps = acc.compute_epsilon(flat, 1e-5)
    assert acc.compute_epsilon(nested, 1e-5) == eps and len(runs) == 1
    # the same event at another δ, other orders or another accountant is accounted again
    assert acc.compute_epsilon(flat, 1e-6) > eps
    assert acc.compute_epsilon(flat, 1e-5, orders=acc.REFERENCE_RDP_ORDERS) >= eps
    assert 0 < acc.compute_epsilon(flat, 1e-5, accountant="pld") < eps  # PLD: tighter than RDP here
    assert len(runs) == 4
    # and a fresh accountant, composing the nested spelling as given, agrees
    fresh = dp_accounting.rdp.RdpAccountant(list(acc.DEFAULT_RDP_ORDERS))
    fresh.compose(nested)
    assert fresh.get_epsilon(1e-5) == pytest.approx(eps, rel=1e-12)
