"""Issue 71 item 4: a fit validates ε and δ once, at its boundary (`AltMinConfig.resolve` with the declared number of
users), and calibrates each noise multiplier of its plan once: `plan_run` recalibrates the training σ only when a
public branch (rank, steps, count release) changes the releases, and the rank check's re-plan calibrates nothing
it has calibrated before. The counts were 3 validations and 4 / 13 calibrations per fit before (7 validations in
one `jdp altmin` run)."""
import collections
import dataclasses
import sys

import pytest

from jdp import validation
from jdp.altmin import AltMinConfig, fit, plan
from jdp.cli import main
from jdp.data import planted_powerlaw


@pytest.fixture
def counts(monkeypatch):
    """Counts the calls of the privacy rule (every module's binding), of `resolve`, of `calibrate_noise` and of the
    root finding itself (`jdp.accounting.calibrate` as plan.py calls it); the calibration cache starts empty."""
    counter = collections.Counter()

    def counted(name, f):
        def call(*args, **kwargs):
            counter[name] += 1
            return f(*args, **kwargs)
        return call

    rule = validation.check_privacy
    for module in [m for name, m in sys.modules.items() if name.startswith("jdp") and m is not None]:
        if getattr(module, "check_privacy", None) is rule:
            monkeypatch.setattr(module, "check_privacy", counted("check_privacy", rule))
    monkeypatch.setattr(AltMinConfig, "resolve", counted("resolve", AltMinConfig.resolve))
    monkeypatch.setattr(plan, "calibrate", counted("calibrate", plan.calibrate))
    monkeypatch.setattr(plan, "calibrate_noise", counted("calibrate_noise", plan.calibrate_noise))
    plan._calibrate_noise.cache_clear()
    return counter


DATA = planted_powerlaw(seed=1, n_users=500, n_items=90, nnz=8000).data


@pytest.mark.parametrize("cfg, calibrations", [
    # nothing left to the plan: one calibration of the run's noise (the counts' σ, then the training σ)
    (AltMinConfig(method="ada-dpals", epsilon=1.0, dim=2, steps=2, count_release=True), dict(calibrate_noise=1,
                                                                                           calibrate=2)),
    # rank 0 and one step chosen by the plan: the training σ again for the new releases, the counts' σ kept
    (AltMinConfig(method="ada-dpals", epsilon=1.0), dict(calibrate_noise=2, calibrate=3)),
    # the rank check (a release of the users' sizes, then a re-plan): size and counts calibrated once each
    (AltMinConfig(method="dpals-tail", epsilon=20.0), dict(calibrate_noise=5, calibrate=5)),
])
def test_a_fit_validates_once_and_calibrates_each_part_once(counts, cfg, calibrations):
    model = fit(DATA, dataclasses.replace(cfg, show_progress=False), seed=0)
    assert counts["check_privacy"] == 1 and counts["resolve"] == 1
    assert {k: counts[k] for k in calibrations} == calibrations
    assert model.report.epsilon() == pytest.approx(cfg.epsilon, rel=1e-4)


def test_a_cli_run_validates_before_any_work_and_in_fit(counts, capsys):
    """`jdp altmin`: once with the flags' names before the data are generated, once in `fit` (the library's
    boundary); the zero-cost baseline's own configuration (nothing released) is the third."""
    assert main(["altmin", "--synthetic-size", "400", "80", "6000", "--epsilon", "2", "--seed", "0"]) == 0
    assert counts["check_privacy"] == 3 and counts["resolve"] == 3
    assert counts["calibrate"] == 3
    assert "total epsilon = 2.0000" in capsys.readouterr().out
