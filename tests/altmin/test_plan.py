"""jdp.altmin.plan: the releases of a run, their calibration and the plan fixed from public quantities."""
import dp_accounting
import pytest

from jdp.accounting import compute_epsilon
from jdp.altmin.config import AltMinConfig
from jdp.altmin.plan import (KEPT_COUNTS, calibrate_noise, candidate_event, default_dim, plan_run,
                             released_ratings_per_user, run_releases)


def test_the_non_private_reference_has_one_non_private_release_and_no_event():
    plan = plan_run(AltMinConfig(method="als"), 100, 20)
    assert plan.noise is None and [r.name for r in plan.releases] == ["NON-PRIVATE reference (exact statistics)"]
    with pytest.raises(ValueError, match="non-private reference"):
        candidate_event(AltMinConfig(method="als"), 100, 20)
    with pytest.raises(ValueError, match="non-private reference"):
        calibrate_noise(AltMinConfig(method="als").resolve())


@pytest.mark.parametrize("method", ["dpals-uniform", "dpsgd-tail", "ada-dpsgd"])
def test_the_plan_spends_exactly_epsilon_and_lists_what_it_composed(method):
    plan = plan_run(AltMinConfig(method=method, epsilon=2.0, steps=2), 2000, 100)
    assert plan.releases == run_releases(plan.config, plan.noise)
    assert compute_epsilon(plan.event(), 1e-5) == pytest.approx(2.0, rel=1e-2)
    assert isinstance(candidate_event(AltMinConfig(method=method, epsilon=2.0, steps=2), 2000, 100),
                      dp_accounting.ComposedDpEvent)
    assert (KEPT_COUNTS in [r.name for r in plan.releases]) == (method == "dpsgd-tail")


def test_rank_zero_takes_one_step_and_noisy_gd_stays_at_rank_zero():
    small = plan_run(AltMinConfig(method="ada-dpals", epsilon=0.5), 200, 100).config
    assert small.dim == 0 and small.steps == 1 and small.label_norm is not None
    assert plan_run(AltMinConfig(method="dpsgd-uniform", epsilon=20.0), 100_000, 100).config.dim == 0


def test_the_rank_check_releases_the_users_sizes_only_when_the_rule_would_pick_factors():
    big = plan_run(AltMinConfig(method="dpals-uniform", epsilon=20.0), 200_000, 200)
    assert big.noise.size is not None and big.config.dim > 0
    assert big.releases[0].name.startswith("ratings per user")
    declared = plan_run(AltMinConfig(method="dpals-uniform", epsilon=20.0, ratings_per_user=100.0), 200_000, 200)
    assert declared.noise.size is None
    assert released_ratings_per_user(-1e9, 100, AltMinConfig(budget=10), 1.0) == 0.0
    assert released_ratings_per_user(1e9, 100, AltMinConfig(budget=10), 1.0) == 10.0
    assert default_dim(10, 10, 100, 100.0) == 0
