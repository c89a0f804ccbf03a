"""Audit item 11: hyper-parameter tuning is either accounted (tune_private) or declared in the report."""
import math

import jax
import numpy as np
import pytest

from jdp.accounting import NONPRIVATE_TUNING, PrivacyReport
from jdp.altmin import AltMinConfig, tune_private
from jdp.altmin.tuning import user_validation_losses
from jdp.data import planted_powerlaw, split_ratings
from jdp.selection import probabilities, select_configuration


def test_configuration_selection_worst_neighbour_ratio():
    """Audit item 11: one user moves every score by up to B in the same direction; the monotone
    permute-and-flip choice changes each candidate's probability by at most e^ε."""
    rng = np.random.default_rng(0)
    eps, bound = 0.7, 3.0
    worst = 0.0
    for _ in range(200):
        k = int(rng.integers(2, 9))
        q = rng.normal(0, 4, k)
        shift = bound * rng.choice([0.0, 1.0, rng.uniform()], k)  # the user's term for each candidate
        p = probabilities("pf", q, np.full(k, bound), eps, monotone=True)
        p_nb = probabilities("pf", q - shift, np.full(k, bound), eps, monotone=True)  # that user added
        worst = max(worst, np.max(np.abs(np.log(p) - np.log(p_nb))))
    assert worst <= eps + 1e-9
    assert worst > 0.5 * eps  # the family reaches the worst case, so the check has teeth


def test_select_configuration_records_its_release_and_validates():
    """Audit item 11: the private choice is a recorded ε-DP release."""
    report = PrivacyReport(1e-5)
    idx = select_configuration(jax.random.key(1), np.array([-10.0, -1.0, -50.0]), 2.0, 0.5, report)
    assert idx in (0, 1, 2)
    assert report.epsilon() == pytest.approx(0.5, abs=1e-3) and report.releases[0].sensitivity == 2.0
    with pytest.raises(ValueError, match="scores"):
        select_configuration(jax.random.key(1), np.array([1.0]), 2.0, 0.5)
    with pytest.raises(ValueError, match="score_bound"):
        select_configuration(jax.random.key(1), np.array([1.0, 2.0]), 0.0, 0.5)


@pytest.mark.slow
def test_tune_private_accounts_every_candidate_and_the_choice():
    """Audit item 11: K candidate runs + the selection compose to at most the requested ε."""
    data = planted_powerlaw(seed=0, n_users=300, n_items=50, nnz=6_000).data
    train, valid, _ = split_ratings(data, (0.8, 0.1, 0.1), seed=0)
    grid = [AltMinConfig(method="dpals-uniform", epsilon=1.0, dim=d, steps=1, rating_range=(0.5, 5.0),
                         show_progress=False) for d in (2, 4)]
    res = tune_private(train, valid, grid, epsilon=2.0, seed=3)
    assert res.report.epsilon() <= 2.0 * (1 + 1e-6)
    assert res.report.epsilon() >= 1.9  # the budget is used, not wasted
    names = [r.name for r in res.report.releases]
    assert sum(n.startswith("candidate 0") for n in names) == sum(n.startswith("candidate 1") for n in names) > 0
    assert names[-1].startswith("hyper-parameter selection")
    assert 0.2 * 2.0 / 2 < res.run_epsilon < 2.0  # each run gets more than basic composition would give
    losses = user_validation_losses(res.model, train, valid)
    assert losses.min() >= 0  # each user's term is truncated at the bound ((hi - lo) / 2)² by the score
    assert res.report.releases[-1].sensitivity == pytest.approx(((5.0 - 0.5) / 2) ** 2)
    with pytest.raises(ValueError, match="configs"):
        tune_private(train, valid, grid[:1], epsilon=2.0, seed=3)
    with pytest.raises(ValueError, match="non-private"):
        tune_private(train, valid, [AltMinConfig(method="als")] * 2, epsilon=2.0, seed=3)


def test_nonprivate_tuning_is_declared_in_benchmark_reports():
    """Audit item 11: rows whose setting was picked on validation data say so in their privacy report."""
    from benchmarks.altmin.quality import _tagged
    report = PrivacyReport(1e-5).add_gaussian("x", 1.0, 2.0)
    row = _tagged({"epsilon": 1.0, "privacy": report.to_dict()}, "d", {"dim": 4})
    assert NONPRIVATE_TUNING in row["privacy"]["assumptions"]
    assert "assumes: hyper-parameters chosen non-privately" in str(report.assume(NONPRIVATE_TUNING))
    assert report.to_dict()["assumptions"] == [NONPRIVATE_TUNING]
    assert math.isfinite(report.epsilon())


@pytest.mark.slow  # CI runs it (make test-slow); tune_private's own accounting test stays in the default suite
def test_fit_tune_private_reports_the_whole_tuning():
    """fit(tune='private') runs the public grid (defaults, ridge ×1/2 / ×4, budget ×1/2 / ×2) and one report
    holds every candidate and the choice, at most the requested ε."""
    from jdp.altmin import fit
    from jdp.altmin.tuning import public_grid
    data = planted_powerlaw(seed=0, n_users=300, n_items=50, nnz=6_000).data
    cfg = AltMinConfig(method="ada-dpals", epsilon=3.0, rating_range=(0.5, 5.0), show_progress=False)
    grid = public_grid(cfg)
    assert [(c.reg_scale, c.budget) for c in grid] == [(2.0, 100), (1.0, 100), (8.0, 100), (2.0, 50), (2.0, 200)]
    model = fit(data, cfg, seed=1, tune="private")
    assert 2.9 <= model.report.epsilon() <= 3.0 * (1 + 1e-6)
    names = [r.name for r in model.report.releases]
    assert {n.split(":")[0] for n in names if n.startswith("candidate")} == {f"candidate {c}" for c in range(5)}
    assert any("chosen privately" in a for a in model.report.assumptions)
    with pytest.raises(ValueError, match="tune"):
        fit(data, cfg, tune="validation")
    with pytest.raises(ValueError, match="non-private"):
        fit(data, AltMinConfig(method="als"), tune="private")


def test_fit_tune_private_default_split_moves_no_other_users_rows(monkeypatch):
    """Issue #69 item 3: fit(tune='private') without `valid` splits the private data itself. tune_private's
    analysis assumes neighbouring inputs differ in one user's rows only, in train and in valid; with the
    former permutation split, removing one user moved hundreds of rows of other users between the parts."""
    import jdp.altmin.tuning as tuning
    from jdp.altmin import fit
    seen = []

    def capture(train, valid, configs, **kwargs):
        seen.append((train, valid))
        raise _Captured

    monkeypatch.setattr(tuning, "tune_private", capture)
    data = planted_powerlaw(seed=0, n_users=200, n_items=50, nnz=4_000).data
    cfg = AltMinConfig(method="ada-dpals", epsilon=3.0, rating_range=(0.5, 5.0), show_progress=False)
    for user in (0, 7):
        seen.clear()
        for d in (data, data.subset(data.user != user)):
            with pytest.raises(_Captured):
                fit(d, cfg, seed=1, tune="private")
        (train, valid), (train_n, valid_n) = seen
        assert 0.08 < valid.nnz / data.nnz < 0.12 and train.nnz + valid.nnz == data.nnz
        for part, neighbour in ((train, train_n), (valid, valid_n)):
            keep = part.user != user
            rows = sorted(zip(part.user[keep].tolist(), part.item[keep].tolist(), part.rating[keep].tolist()))
            assert rows == sorted(zip(neighbour.user.tolist(), neighbour.item.tolist(), neighbour.rating.tolist()))


class _Captured(Exception):
    pass
