"""Audit item 5: `calibrate` and `compute_epsilon` must agree for every event type jdp builds."""
import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting import rdp

from jdp import accounting as acc
from jdp.accounting import calibrate, compute_epsilon, gaussian_event, pure_dp_event

DELTA = 1e-5


def _gaussian_steps(s):
    return dpe.SelfComposedDpEvent(gaussian_event(s), 20)


def _composed_gaussians(s):  # altmin: counts + mean + SSP steps (A and b) composed
    step = dpe.ComposedDpEvent([gaussian_event(s), gaussian_event(s)])
    return dpe.ComposedDpEvent([gaussian_event(4 * s), dpe.SelfComposedDpEvent(step, 5)])


def _dp_sgd(s):
    return dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.01, gaussian_event(s)), 500)


def _pure_self_composed(s):  # the audit's repro: 10 selections at ε = 1/s each
    return dpe.SelfComposedDpEvent(pure_dp_event(1 / s), 10)


def _pure_nested(s):  # combined GEM (two pure parts) repeated, as selection reports record it
    pair = dpe.ComposedDpEvent([pure_dp_event(0.3 / s), pure_dp_event(0.7 / s)])
    return dpe.ComposedDpEvent([dpe.SelfComposedDpEvent(pair, 4), pure_dp_event(1 / s)])


@pytest.mark.parametrize("make_event", [_gaussian_steps, _composed_gaussians, _dp_sgd,
                                        _pure_self_composed, _pure_nested])
@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_calibrate_agrees_with_compute_epsilon(make_event, epsilon):
    """Audit item 5: the calibrated parameter spends at most ε by compute_epsilon, and not much less."""
    s = calibrate(make_event, epsilon, DELTA)  # default bracket: used to overflow for pure events
    spent = compute_epsilon(make_event(s), DELTA)
    assert spent <= epsilon * (1 + 1e-6)
    assert spent >= 0.97 * epsilon


@pytest.mark.parametrize("scale", [1e-3, 0.3, 7.0, 2e3])
def test_calibrate_finds_roots_far_from_one_and_respects_the_bracket(scale):
    # the root search starts at 1 and walks out by ×4: roots far on either side, a root below the bracket
    # (the bracket's low end is returned: it already spends ≤ ε) and one above it (error) are all handled
    def event(s):
        return gaussian_event(s / scale)
    s = calibrate(event, 1.0, DELTA, bracket=(1e-6, 1e7))
    assert compute_epsilon(event(s), DELTA) <= 1.0 * (1 + 1e-9)
    assert compute_epsilon(event(s * (1 - 1e-4)), DELTA) > 1.0  # the smallest such parameter, to 1e-4
    root = s
    assert calibrate(event, 1.0, DELTA, bracket=(2 * root, 4 * root)) == 2 * root
    with pytest.raises(ValueError, match="cannot reach"):
        calibrate(event, 1.0, DELTA, bracket=(root / 8, root / 2))


def test_self_composed_pure_dp_calibration_counts_every_release():
    """Audit item 5 repro: 10 self-composed ε/10 releases calibrated to total ε = 1.

    Basic composition needs s = 10; the PLD at δ = 1e-5 may save a little, never a factor 10
    (the old calibrate returned s ≈ 1, whose true total is ε ≈ 10)."""
    s = calibrate(_pure_self_composed, 1.0, DELTA, bracket=(0.5, 100.0))
    assert 9.0 < s <= 10.0 + 1e-6
    assert compute_epsilon(_pure_self_composed(1.0), DELTA) > 9.0


def test_pure_dp_event_large_epsilon_does_not_overflow():
    """Audit item 5: a calibration bracket probes ε = 1000; the event must exist and spend ≥ that."""
    for eps in (50.0, 1000.0, 1e6):
        event = pure_dp_event(eps)
        assert 0.0 <= event.noise_parameter < 1e-20
        assert compute_epsilon(event, DELTA) >= 0.99 * min(eps, 700.0)  # inf once e^-ε underflows
    p = pure_dp_event(1.0).noise_parameter
    assert p == pytest.approx(2 / (1 + math.e), rel=1e-12)


def test_relation_is_passed_to_the_accountant_and_calibration_agrees():
    """Every accountant is built in jdp.accounting: an explicit relation reaches dp_accounting, and
    calibrate under it agrees with compute_epsilon (tree aggregation is defined under REPLACE_SPECIAL only)."""
    from dp_accounting import NeighboringRelation as NR

    from jdp.accounting import make_accountant
    assert make_accountant(relation=NR.REPLACE_SPECIAL).neighboring_relation is NR.REPLACE_SPECIAL
    tree = lambda s: dpe.SingleEpochTreeAggregationDpEvent(s, 64)  # noqa: E731
    with pytest.raises(ValueError, match="does not support"):
        compute_epsilon(tree(1.0), DELTA)  # not defined under add/remove
    s = calibrate(tree, 1.0, DELTA, relation=NR.REPLACE_SPECIAL)
    spent = compute_epsilon(tree(s), DELTA, relation=NR.REPLACE_SPECIAL)
    assert 0.97 <= spent <= 1.0 + 1e-6
    # PLD under REPLACE_ONE counts a Gaussian at twice its add/remove sensitivity
    g = dpe.GaussianDpEvent(4.0)
    assert compute_epsilon(g, DELTA, "pld", relation=NR.REPLACE_ONE) == pytest.approx(
        compute_epsilon(dpe.GaussianDpEvent(2.0), DELTA, "pld"), rel=1e-3)
    with pytest.raises(ValueError, match="relation"):
        make_accountant(relation="add/remove")


def test_reports_of_different_relations_never_compose_by_accident():
    """The neighbouring relation is data: a report refuses a release (or another report) stated under another
    relation or unit, free-text relations are refused, and epsilon_by_relation composes only descriptions
    that one accountant can hold."""
    from jdp.accounting import (ADD_OR_REMOVE_ONE, REPLACE_ONE, REPLACE_SPECIAL, PrivacyReport, Release,
                                Restatement, check_relation)
    assert check_relation("replace_one") is REPLACE_ONE and check_relation(REPLACE_SPECIAL) is REPLACE_SPECIAL
    for bad in ("add/remove one user", "replace", 1):
        with pytest.raises(ValueError, match="relation"):
            PrivacyReport(DELTA, relation=bad)
    add = PrivacyReport(DELTA).add_gaussian("g", 1.0, 4.0)
    rep = PrivacyReport(DELTA, relation=REPLACE_ONE).add("g", dpe.GaussianDpEvent(2.0), 2.0, 4.0)
    with pytest.raises(ValueError, match="REPLACE_ONE.*ADD_OR_REMOVE_ONE"):
        add.add("h", dpe.GaussianDpEvent(2.0), relation=REPLACE_ONE)
    with pytest.raises(ValueError, match="stated under REPLACE_ONE"):
        add.extend(rep)
    with pytest.raises(ValueError, match="stated under REPLACE_ONE"):
        add.add_release(rep.releases[0])
    with pytest.raises(ValueError, match="unit"):
        add.extend(PrivacyReport(DELTA, unit="task"))
    with pytest.raises(ValueError, match="stated under"):
        PrivacyReport(DELTA, releases=[Release("r", dpe.GaussianDpEvent(1.0), relation=REPLACE_SPECIAL)])
    # the report's epsilon is computed under its own relation
    assert rep.epsilon() == pytest.approx(compute_epsilon(dpe.GaussianDpEvent(2.0), DELTA, relation=REPLACE_ONE))
    assert rep.to_dict()["releases"][0]["relation"] == "replace_one"
    # restated under replace-one (sensitivity 2C: multiplier halves), the same noise protects less
    restated = PrivacyReport(DELTA).add("g", dpe.GaussianDpEvent(4.0), 1.0, 4.0,
                                        restated=[Restatement(REPLACE_ONE, dpe.GaussianDpEvent(2.0))])
    by = restated.epsilon_by_relation((ADD_OR_REMOVE_ONE, REPLACE_ONE, REPLACE_SPECIAL))
    assert by[ADD_OR_REMOVE_ONE] == pytest.approx(compute_epsilon(dpe.GaussianDpEvent(4.0), DELTA))
    assert by[REPLACE_ONE] == pytest.approx(compute_epsilon(dpe.GaussianDpEvent(2.0), DELTA, relation=REPLACE_ONE))
    assert by[REPLACE_ONE] > 1.5 * by[ADD_OR_REMOVE_ONE] and by[REPLACE_SPECIAL] is None
    # a second release restated through another accountant cannot join the same composition
    restated.add("h", dpe.GaussianDpEvent(4.0), 1.0, 4.0,
                 restated=[Restatement(REPLACE_ONE, dpe.GaussianDpEvent(2.0), "pld")])
    with pytest.raises(ValueError, match="cannot be composed"):
        restated.epsilon_by_relation((REPLACE_ONE,))


def test_delta_at_or_above_one_over_n_is_refused_and_near_it_warned():
    # publishing one random unit in the clear is (0, 1/n)-DP: such a delta guarantees nothing
    import warnings

    import optax

    import jdp.clipping as jc
    from jdp.validation import check_delta
    with pytest.raises(ValueError, match="1/n"):
        check_delta(0.1, num_units=10)
    with pytest.warns(UserWarning, match="1/\\(10 n\\)"):
        check_delta(0.05, num_units=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_delta(0.01, num_units=10) == 0.01
    with warnings.catch_warnings(record=True) as seen:  # a run that checks one δ in two layers warns once
        warnings.simplefilter("default")
        check_delta(0.05, num_units=10)
        check_delta(0.05, num_units=10)
    assert len(seen) == 1
    with pytest.raises(ValueError, match="1/n"):
        jc.dp_sgd(lambda p, b: b, optax.sgd(0.1), num_examples=10, batch_size=2, l2_clip=1.0,
                  delta=0.5, steps=2, noise_multiplier=1.0)


def test_events_that_print_alike_are_accounted_apart(monkeypatch):
    # numpy prints an array's floats to 8 digits: these two noise multipliers share a repr, not a value,
    # so each must get its own accounting (a repr-keyed memo would return the first one's ε for both)
    monkeypatch.setattr(acc.events, "_ACCOUNTED", {})
    events = [dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.01, dpe.GaussianDpEvent(np.array(z))), 100)
              for z in (0.7000000001, 0.7000000049)]
    assert repr(events[0]) == repr(events[1])
    for event in events:
        fresh = rdp.RdpAccountant(list(acc.DEFAULT_RDP_ORDERS))
        fresh.compose(event)
        assert acc.compute_epsilon(event, 1e-5) == fresh.get_epsilon(1e-5)
    assert acc.compute_epsilon(events[0], 1e-5) > acc.compute_epsilon(events[1], 1e-5)
    assert len(acc.events._ACCOUNTED) == 2
    # a field the key cannot read exactly is accounted afresh, never keyed by an approximation
    assert acc.events._event_key(dpe.GaussianDpEvent(object())) is None


def _composed_dp_sgd(s):  # seqrec: a released histogram beside the DP-SGD steps
    return dpe.ComposedDpEvent([gaussian_event(4.0), dpe.SelfComposedDpEvent(
        dpe.PoissonSampledDpEvent(0.128, gaussian_event(s)), 16)])


@pytest.mark.parametrize("make_event, epsilon", [
    (_dp_sgd, 0.5), (_dp_sgd, 2.0), (_composed_dp_sgd, 8.0), (_composed_gaussians, 1.0),
    (lambda s: dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.5, gaussian_event(s)), 40), 20.0),
    (lambda s: gaussian_event(s), 1000.0),  # ε attained at the smallest order (1.1)
    (lambda s: gaussian_event(s), 0.005)])  # and at the largest (1024)
def test_calibrate_over_windows_of_orders_finds_the_every_order_root(make_event, epsilon, monkeypatch):
    """`calibrate` accounts Brent's candidates over a few orders around the optimum only. Its root must be the one
    a search over every order finds (the window then spans every order), spend at most ε over every order, and
    take few every-order accountings beyond the bracket's (the root and, rarely, one repeat)."""
    full = len(acc.DEFAULT_RDP_ORDERS)
    calls = []
    account = acc.events._account
    monkeypatch.setattr(acc.events, "_account", lambda event, *args: calls.append(len(args[2])) or account(event, *args))
    acc.events._ACCOUNTED.clear()
    s = calibrate(make_event, epsilon, DELTA, bracket=(1e-3, 1e5))
    walk = 2 + math.ceil(abs(math.log(s)) / math.log(4.0))  # the bracket's steps of ×4 from 1, over every order
    assert sum(n == full for n in calls) <= walk + 2
    assert compute_epsilon(make_event(s), DELTA) <= epsilon
    for window in (full, 0):  # every order at every step; one order at a time (only the every-order checks find
        monkeypatch.setattr(acc.calibration, "_ORDER_WINDOW", window)  # the optimum)
        acc.events._ACCOUNTED.clear()
        assert s == pytest.approx(calibrate(make_event, epsilon, DELTA, bracket=(1e-3, 1e5)), rel=1e-5)


def _tight_delta_of_pure_composition(eps: float, k: int, eps_prime: float) -> float:
    """δ(ε') of k-fold composition of ε-DP, exact: the dominating pair is k-fold binary randomized
    response, whose privacy loss is ε·(k − 2i) with i ~ Binomial(k, 1/(1 + e^ε)) (Kairouz et al. 2015)."""
    q = 1.0 / (1.0 + math.exp(eps))
    return sum(math.comb(k, i) * q**i * (1 - q) ** (k - i) * max(0.0, 1.0 - math.exp(eps_prime - eps * (k - 2 * i)))
               for i in range(k + 1))


@pytest.mark.parametrize("count", [1, 5])
def test_pure_dp_events_under_replace_special_count_as_a_general_eps_dp_mechanism(count):
    """Issue #69 item 4: under REPLACE_SPECIAL, dp_accounting analyses randomized response against a
    uniform "special" output, not as the worst case of an ε-DP mechanism: one ε = 1 selection was
    reported as ε = 0.625 and five as 3.10. The reported ε must be a valid bound at δ for k-fold ε-DP
    (checked against the exact tight δ(ε')) and agree with the add/remove (i.e. worst-case) value."""
    from jdp.accounting import REPLACE_SPECIAL, PrivacyReport
    delta = 1e-6
    report = PrivacyReport(delta, relation=REPLACE_SPECIAL).add("selection", pure_dp_event(1.0), count=count)
    eps = report.epsilon()
    assert _tight_delta_of_pure_composition(1.0, count, eps) <= delta * (1 + 1e-3)  # a valid (ε, δ)
    assert eps >= count - 1e-4 and eps > {1: 0.63, 5: 3.2}[count]  # 0.625 / 3.10 before
    assert eps == pytest.approx(compute_epsilon(pure_dp_event(1.0) if count == 1 else
                                                dpe.SelfComposedDpEvent(pure_dp_event(1.0), count), delta), abs=1e-9)
    assert report.pure_epsilon() == pytest.approx(count)
    # the previous value fails the exact check by orders of magnitude
    assert _tight_delta_of_pure_composition(1.0, count, {1: 0.625, 5: 3.10}[count]) > 1e-2
    # mixed with an event only REPLACE_SPECIAL analyses (tree aggregation): basic composition adds ≥ k·ε
    tree = dpe.SingleEpochTreeAggregationDpEvent(2.0, 16)
    mixed = compute_epsilon(dpe.ComposedDpEvent([tree, dpe.SelfComposedDpEvent(pure_dp_event(1.0), count)]),
                            delta, relation=REPLACE_SPECIAL)
    assert mixed >= compute_epsilon(tree, delta, relation=REPLACE_SPECIAL) + count - 1e-4
    # and calibration under REPLACE_SPECIAL uses the same rule: 5 selections at total ε = 2 need ε/5 each
    s = calibrate(lambda x: dpe.SelfComposedDpEvent(pure_dp_event(1.0 / x), count), 2.0, delta,
                  bracket=(0.1, 100.0), relation=REPLACE_SPECIAL)
    assert s >= 0.999 * count / 2.0
