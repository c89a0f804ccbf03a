"""User-level privacy of jdp.altmin / jdp.multitask: duplicate (user, item) pairs, worst-case per-user
contributions against the recorded sensitivities, and public sizes under add/remove-one-user.

Unit of privacy: a user; neighbouring datasets add or remove all ratings of one user. Every
"contribution" below is measured as the difference of a routine's (noise-coupled) statistics on two
neighbouring inputs, with the user chosen to maximise it, and compared with the sensitivity the
routine records in its PrivacyReport.
"""
import dataclasses

import dp_accounting

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.accounting import PrivacyReport, compute_epsilon
from jdp.altmin import METHODS, AltMinConfig, Method, candidate_event, fit
from jdp.altmin.model import KEPT_COUNTS, NOISY_GD, plan_run
from jdp.data import Interactions, planted_powerlaw
from jdp.multitask import gram
from jdp.multitask import weights as W
from jdp.multitask.counts import private_counts
from jdp.multitask.noisy_gd import NoisyGDConfig, task_weighted_noisy_gd
from jdp.multitask.ssp import clip_label_norms, record_ssp_releases


@pytest.fixture(scope="module")
def ratings():
    return planted_powerlaw(seed=1, n_users=300, n_items=60, nnz=6000, rank=3).data


def _with_rows(data: Interactions, user, item, rating, n_users=None) -> Interactions:
    return Interactions(np.r_[data.user, user], np.r_[data.item, item], np.r_[data.rating, rating],
                        data.n_users if n_users is None else n_users, data.n_items)


COUNT_RELEASES = ("item counts", KEPT_COUNTS)


def _cfg(method, **kw):
    kw = {"epsilon": None if method == "als" else 2.0, "steps": 1, **kw}
    return AltMinConfig(method=method, show_progress=False, sgd_inner_steps=1, **kw)


# --------------------------------------------------------------------------------------------------
# The report of a fit is the event its noise was calibrated against.

@pytest.mark.parametrize("method", [m for m in METHODS if Method.parse(m).private])
def test_report_after_fit_is_the_event_calibration_used(ratings, method):
    """Every private method, with every pre-processing release (private mean, counts where read): the releases
    fit records compose to exactly the event that the noise was calibrated on and that candidate_event hands
    to tune_private, so the report spends at most ε (and all of it)."""
    rule = Method.parse(method).rule
    cfg = _cfg(method, epsilon=1.5, global_mean="private", dim=2, steps=2)
    model = fit(ratings, cfg, seed=0)
    rep, calibrated = model.report, candidate_event(cfg, ratings.n_users, ratings.n_items)
    assert repr(rep.event()) == repr(calibrated)
    assert rep.epsilon() == compute_epsilon(calibrated, cfg.delta)
    assert cfg.epsilon * (1 - 1e-3) <= rep.epsilon() <= cfg.epsilon * (1 + 1e-6)
    plan = plan_run(cfg, ratings.n_users, ratings.n_items)
    assert repr(plan.event()) == repr(calibrated) and plan.config == model.config
    sigma_mean, sigma_counts, sigma = plan.noise.mean, plan.noise.counts, plan.noise.training
    assert plan.noise.size is None  # dim given: no rank check
    assert model.noise_multiplier == sigma
    names = [r.name for r in rep.releases]
    assert names[:2] == ["global mean (sum)", "global mean (count)"]
    assert ("item counts" in names) == plan.config.releases_counts == (sigma_counts is not None)
    assert (KEPT_COUNTS in names) == (method == "dpsgd-tail")  # its step caps read the kept ratings' counts
    assert plan.config.releases_counts <= Method.parse(method).needs_counts
    for r in rep.releases:  # each release's noise std is its σ times its sensitivity
        s = sigma_mean if r.name.startswith("global mean") else sigma_counts if r.name in COUNT_RELEASES else sigma
        assert r.noise_scale == pytest.approx(s * r.sensitivity, rel=1e-12)
    steps = [r for r in rep.releases if r.name.startswith("item update")]
    assert [r.count for r in steps] == ([2] if rule == NOISY_GD else [2, 2])  # steps × 1 inner step


# --------------------------------------------------------------------------------------------------
# Item 1: duplicate (user, item) pairs.

@pytest.mark.parametrize("method", METHODS)
def test_fit_rejects_duplicate_pairs_for_every_method(ratings, method):
    """Audit item 1: the repro (10 extra copies of one of a user's rows) must not run, for every method."""
    row = int(np.flatnonzero(ratings.user == ratings.user[0])[0])
    u, i = int(ratings.user[row]), int(ratings.item[row])
    dup = _with_rows(ratings, np.full(10, u), np.full(10, i), np.full(10, ratings.rating[row]))
    with pytest.raises(ValueError, match=rf"10 duplicate \(user, item\) rows, e\.g\. user {u}, item {i} occurs 11 times"):
        fit(dup, _cfg(method, dim=2))


def test_fit_merge_duplicates_opt_in_equals_fit_on_merged_data(ratings):
    """Audit item 1: the explicit opt-in merges duplicates (mean rating per pair) before anything private."""
    row = int(np.flatnonzero(ratings.user == ratings.user[5])[0])
    u, i = ratings.user[row], ratings.item[row]
    dup = _with_rows(ratings, np.full(3, u), np.full(3, i), np.array([1.0, 2.0, 3.0]))
    merged = dup.merge_duplicates()
    assert merged.nnz == ratings.nnz
    expect = ratings.rating.copy()
    expect[row] = np.mean([ratings.rating[row], 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(merged.user, ratings.user)
    np.testing.assert_array_equal(merged.item, ratings.item)
    np.testing.assert_allclose(merged.rating, expect, rtol=1e-6)
    model = fit(dup, _cfg("dpsgd-uniform", dim=2, merge_duplicates=True), seed=0)
    ref = fit(merged, _cfg("dpsgd-uniform", dim=2), seed=0)
    np.testing.assert_array_equal(model.item_factors, ref.item_factors)
    assert any("merged" in a for a in model.report.assumptions)


def test_duplicate_detection_and_merge_match_a_reference():
    """Audit item 1: count / example pair of the ValueError and the merged means, against a dict reference."""
    from jdp.data import check_unique_pairs, duplicate_pairs

    rng = np.random.default_rng(0)
    n = 4000
    user, item = rng.integers(0, 50, n), rng.integers(0, 40, n)  # ~2000 pairs: many duplicates
    rating, ts = rng.uniform(1, 5, n).astype(np.float32), rng.integers(0, 10**9, n)
    groups = {}
    for r, (u, i) in enumerate(zip(user.tolist(), item.tolist())):
        groups.setdefault((u, i), []).append(r)
    n_dup, (u0, i0, mult) = duplicate_pairs(user, item)
    assert n_dup == n - len(groups) and mult == len(groups[(u0, i0)]) >= 2
    with pytest.raises(ValueError, match=rf"{n_dup} duplicate \(user, item\) rows, e\.g\. user {u0}, item {i0}"):
        check_unique_pairs(user, item)
    data = Interactions(user, item, rating, 50, 40, ts)
    m = data.merge_duplicates()
    firsts = sorted(g[0] for g in groups.values())
    assert m.nnz == len(groups) and duplicate_pairs(m.user, m.item)[0] == 0
    np.testing.assert_array_equal(m.user, user[firsts])
    np.testing.assert_array_equal(m.item, item[firsts])
    for k, r in enumerate(firsts):
        rows = groups[(int(user[r]), int(item[r]))]
        assert m.rating[k] == pytest.approx(float(np.mean(rating[rows].astype(np.float64))), rel=1e-6)
        assert m.timestamp[k] == ts[rows].max()
    assert data.subset(np.asarray(firsts)).merge_duplicates().nnz == len(groups)  # no duplicates: unchanged
    check_unique_pairs(m.user, m.item)


def test_private_counts_worst_case_user_within_recorded_sensitivity():
    """Audit item 1: the user maximising its contribution to the private counts moves them by at most the
    recorded L2 sensitivity √count_sample (attained with distinct items); a user repeating one item must
    be rejected (it would move one count by count_sample)."""
    rng = np.random.default_rng(1)
    m, n, cs = 30, 40, 4
    # other users: 2 ≤ cs items each (all kept whatever the sampling), every item count ≥ 2 (no clamping)
    others_u = np.repeat(np.arange(n - 1), 2)
    others_i = (others_u + np.tile([0, 1], n - 1)) % m
    assert np.bincount(others_i, minlength=m).min() >= 2

    def counts(u, i, rep):
        pc = private_counts(jax.random.key(3), jnp.asarray(u), jnp.asarray(i), m, cs, 1e-3, rep)
        return np.asarray(pc.counts, np.float64)

    worst_users = {"distinct items": rng.choice(m, 3 * cs, replace=False),   # more items than count_sample
                   "one item repeated": np.full(3 * cs, 7)}
    for label, items in worst_users.items():
        rep = PrivacyReport(1e-5)
        without = counts(others_u, others_i, None)
        try:
            with_j = counts(np.r_[others_u, np.full(items.size, n - 1)], np.r_[others_i, items], rep)
        except ValueError as e:
            assert label == "one item repeated" and "duplicate" in str(e)
            continue
        contribution = np.linalg.norm(with_j - without)
        sens = rep.releases[0].sensitivity
        assert contribution <= sens * (1 + 1e-4), (label, contribution, sens)
        assert contribution >= sens * (1 - 1e-3)  # the bound is attained: the worst case is really tested


def test_tail_sample_kept_counts_worst_case_user_within_recorded_sensitivity(ratings):
    """dpsgd-tail's second count release (the ratings its tail sample kept, for the step caps): given the released
    counts that choose the sample, the other users' kept sets do not depend on a user, and a user keeps at most k
    distinct items, so adding the heaviest user moves the kept counts by exactly √k in L2, the sensitivity the
    report records; and the fit releases those counts, not the raw ones, to its step caps."""
    from jdp.altmin import updates as altmin_model
    k = 5
    cfg = _cfg("dpsgd-tail", budget=k)
    plan = plan_run(cfg, ratings.n_users, ratings.n_items)
    (raw, kept_release) = [r for r in plan.releases if r.name in COUNT_RELEASES]
    assert raw.name == "item counts" and kept_release.name == KEPT_COUNTS
    assert kept_release.sensitivity == pytest.approx(np.sqrt(k)) and kept_release.event == raw.event
    released = jnp.asarray(np.random.default_rng(0).uniform(1, 50, ratings.n_items), jnp.float32)
    user, item = jnp.asarray(ratings.user), jnp.asarray(ratings.item)
    heaviest = int(np.argmax(np.bincount(ratings.user)))
    assert np.sum(ratings.user == heaviest) > k

    def kept_counts(rows):
        w = np.asarray(W.tail_sampling_weights(jax.random.key(1), user[rows], item[rows], released, k))
        return np.bincount(ratings.item[rows], weights=(w > 0).astype(np.float64), minlength=ratings.n_items)

    everyone = np.ones(ratings.nnz, bool)
    change = np.linalg.norm(kept_counts(everyone) - kept_counts(ratings.user != heaviest))
    assert change == pytest.approx(kept_release.sensitivity, rel=1e-6)  # the bound, attained
    seen = []
    original = altmin_model.private_counts

    def spy(key, u, i, *args, **kwargs):
        out = original(key, u, i, *args, **kwargs)
        seen.append((kwargs.get("name"), np.asarray(u).size, np.asarray(out.counts)))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(altmin_model, "private_counts", spy)
        steps = []
        mp.setattr(altmin_model, "item_step_sizes", lambda c, n, counts, *a, **kw: steps.append(counts) or
                   np.ones(ratings.n_items, np.float32))
        fit(ratings, cfg, seed=0)
    assert [name for name, _, _ in seen] == [None, KEPT_COUNTS]
    assert seen[1][1] <= k * ratings.n_users  # only kept pairs, ≤ k per user
    np.testing.assert_array_equal(steps[0], seen[1][2])


def test_private_mean_worst_case_user_within_recorded_sensitivity():
    """Audit item 1: the two releases behind the private mean (clipped sum, count) move by at most their
    recorded sensitivities for the worst user (labels beyond the bound, many rows, duplicates included):
    their sensitivities count rows, so duplicates cannot exceed them and need no rejection."""
    from jdp.multitask.counts import private_label_sum

    rng = np.random.default_rng(2)
    n, cs, bound = 50, 5, 2.0
    others_u = np.repeat(np.arange(n - 1), 3)  # ≤ cs rows each: all kept whatever the sampling
    others_y = rng.uniform(-bound, bound, others_u.size)
    for label, rows in {"many rows": 40, "one row repeated": 40}.items():
        y_j = np.full(rows, 10 * bound)  # clipped to the bound: maximal contribution
        rep = PrivacyReport(1e-5)
        s0, c0 = private_label_sum(jax.random.key(4), jnp.asarray(others_u), jnp.asarray(others_y), bound, cs, 1e-4)
        s1, c1 = private_label_sum(jax.random.key(4), jnp.asarray(np.r_[others_u, np.full(rows, n - 1)]),
                                   jnp.asarray(np.r_[others_y, y_j]), bound, cs, 1e-4, rep)
        (sum_rel, cnt_rel) = rep.releases
        assert abs(s1 - s0) <= sum_rel.sensitivity * (1 + 1e-4) and abs(s1 - s0) >= sum_rel.sensitivity * (1 - 1e-3)
        assert abs(c1 - c0) <= cnt_rel.sensitivity * (1 + 1e-4) and abs(c1 - c0) >= cnt_rel.sensitivity * (1 - 1e-3)


def test_budget_clipped_total_worst_case_user_within_recorded_sensitivity():
    """The rank check's release Σ_j min(n_j, k): a user with many rows (or one row repeated) moves it by
    exactly k, its recorded sensitivity, whatever the other users hold."""
    from jdp.multitask.counts import private_total_count

    n, k = 40, 7
    others = np.repeat(np.arange(n - 1), np.arange(n - 1) % 12)  # 0 … 11 rows each: some above k, some below
    for label, rows in {"many rows": 50, "one row repeated": 50, "exactly k rows": k}.items():
        rep = PrivacyReport(1e-5)
        t0 = private_total_count(jax.random.key(3), jnp.asarray(others), n, k, 1e-4)
        t1 = private_total_count(jax.random.key(3), jnp.asarray(np.r_[others, np.full(rows, n - 1)]), n, k, 1e-4, rep)
        (release,) = rep.releases
        assert release.sensitivity == k and release.noise_scale == pytest.approx(1e-4 * k)
        assert abs(t1 - t0) <= k * (1 + 1e-4) and abs(t1 - t0) >= k * (1 - 1e-3), label
    with pytest.raises(ValueError, match="user ids"):
        private_total_count(jax.random.key(3), jnp.asarray([0, n]), n, k, 1.0)


def test_rank_check_release_is_accounted_and_only_lowers_the_rank():
    """Light users (20 ratings each, budget k = 100): the rank that assumes every user spends k is checked
    against the released budget-clipped total. The release is in the report beside the others, the whole
    run still spends exactly ε, candidate_event (the optimistic branch, what tune_private composes) gives
    the same ε, and the checked rank is never above the optimistic one (here: 0, biases only)."""
    data = planted_powerlaw(seed=0, n_users=400, n_items=80, nnz=8000).data
    cfg = AltMinConfig(method="ada-dpals", epsilon=5.0, show_progress=False)
    optimistic = plan_run(cfg, data.n_users, data.n_items)
    assert optimistic.config.dim > 0 and optimistic.noise.size is not None
    model = fit(data, cfg, seed=0)
    names = [r.name for r in model.report.releases]
    assert names[0] == "ratings per user (budget-clipped total)"
    size = model.report.releases[0]
    assert size.sensitivity == cfg.budget and size.noise_scale == pytest.approx(optimistic.noise.size * cfg.budget)
    assert model.report.epsilon() == pytest.approx(5.0, rel=1e-3)
    assert compute_epsilon(candidate_event(cfg, data.n_users, data.n_items), cfg.delta) == pytest.approx(5.0, rel=1e-3)
    per_user = model.timings["released_ratings_per_user"]
    assert 0 <= per_user <= 20.5  # a lower bound of the true mean (20): 2 noise stds below the release
    assert model.config.dim == 0 < optimistic.config.dim
    # a declared public r̄ skips the release; a caller-set dim needs no check
    declared = plan_run(dataclasses.replace(cfg, ratings_per_user=20.0), data.n_users, data.n_items)
    assert declared.noise.size is None and declared.config.dim == 0
    assert plan_run(dataclasses.replace(cfg, dim=4), data.n_users, data.n_items).noise.size is None
    with pytest.raises(ValueError, match="ratings_per_user"):
        AltMinConfig(ratings_per_user=101.0).resolve()
    # noisy GD without biases (factors only) keeps the optimistic rank: no size release, subsampled or not
    for rate in (1.0, 0.5):
        sgd = AltMinConfig(method="ada-dpsgd", epsilon=5.0, biases=False, sample_rate=rate, show_progress=False)
        plan = plan_run(sgd, data.n_users, data.n_items)
        assert plan.noise.size is None and plan.config.dim > 1
        assert plan_run(sgd, data.n_users, data.n_items, released_ratings_per_user=0.0).config == plan.config


def _stacked_gram(task, x, y, w, m):
    plan = gram.build_plan(task, np.arange(task.size), w, m)
    classes, si = gram.device_arrays(plan, plan.slot_values(y))
    a, b = gram.gram_unsharded(jnp.asarray(x), classes, si)
    return np.asarray(a, np.float64)[plan.flat_index], np.asarray(b, np.float64)[plan.flat_index]


def test_ssp_statistics_worst_case_user_within_recorded_sensitivity():
    """Audit item 1: the user's TOTAL contribution to the stacked Gram / rhs sums of task-weighted SSP,
    with all its items' features aligned and at the clip, labels at the clip and weights using the
    whole budget (normalize mode), stays within the recorded Frobenius sensitivity √β·Γx² / √β·Γx·Γy.
    A user repeating one item (its copies perfectly aligned) must be rejected by the weights."""
    rng = np.random.default_rng(3)
    m, n, d, beta, gx, gy = 20, 30, 3, 4.0, 1.5, 2.0
    user, task = np.nonzero(rng.random((n - 1, m)) < 0.3)
    x = rng.normal(size=(user.size, d)).astype(np.float32)
    x *= np.minimum(1.0, gx / np.linalg.norm(x, axis=1, keepdims=True))
    y = rng.uniform(-gy, gy, user.size).astype(np.float32)
    counts = jnp.asarray(np.bincount(task, minlength=m).astype(np.float32) + 1.0)  # stand-in released counts
    rep = PrivacyReport(1e-5)
    record_ssp_releases(rep, 1.0, beta, gx, gy)
    sens_a, sens_b = rep.releases[0].sensitivity, rep.releases[1].sensitivity
    e1 = np.zeros(d, np.float32); e1[0] = gx
    worst_users = {"all items, aligned": np.arange(m), "one item repeated": np.full(10, 4)}
    for label, items in worst_users.items():
        u_all, t_all = np.r_[user, np.full(items.size, n - 1)], np.r_[task, items]
        x_all = np.r_[x, np.tile(e1, (items.size, 1))]
        y_all = np.r_[y, np.full(items.size, gy, np.float32)]
        try:
            w = np.asarray(W.adaptive_weights(counts, jnp.asarray(u_all), jnp.asarray(t_all), n, beta, 0.5, "normalize"))
        except ValueError as e:
            assert label == "one item repeated" and "duplicate" in str(e)
            continue
        a1, b1 = _stacked_gram(t_all, x_all, y_all, w, m)
        a0, b0 = _stacked_gram(t_all, x_all, y_all, np.where(u_all == n - 1, 0.0, w), m)
        da, db = np.linalg.norm(a1 - a0), np.linalg.norm(b1 - b0)
        assert da <= sens_a * (1 + 1e-4) and db <= sens_b * (1 + 1e-4), (label, da, sens_a, db, sens_b)
        assert da >= sens_a * (1 - 3e-3) and db >= sens_b * (1 - 3e-3)  # tight: the worst case is tested


def test_ssp_label_norm_clip_worst_case_user_within_recorded_sensitivity():
    """Labels bounded per user (Σ_i w_ij² y_ij² ≤ L², `clip_label_norms`): the worst user (every label at the
    per-rating clip, features aligned at the clip, the whole weight budget) moves the rhs stack by exactly Γx·L,
    the b sensitivity of the releases recorded with the per-rating bound L/√β. A user under L is untouched."""
    rng = np.random.default_rng(4)
    m, n, d, beta, gx, gy = 20, 30, 3, 9.0, 1.5, 2.0
    bound = 0.5 * np.sqrt(beta) * gy
    user, task = np.nonzero(rng.random((n - 1, m)) < 0.3)
    x = rng.normal(size=(user.size, d)).astype(np.float32)
    x *= np.minimum(1.0, gx / np.linalg.norm(x, axis=1, keepdims=True))
    y = rng.uniform(-gy, gy, user.size).astype(np.float32)
    e1 = np.zeros(d, np.float32); e1[0] = gx
    items = np.arange(m)
    u_all, t_all = np.r_[user, np.full(m, n - 1)], np.r_[task, items]
    x_all, y_all = np.r_[x, np.tile(e1, (m, 1))], np.r_[y, np.full(m, gy, np.float32)]
    counts = jnp.asarray(np.bincount(task, minlength=m).astype(np.float32) + 1.0)
    w = np.asarray(W.adaptive_weights(counts, jnp.asarray(u_all), jnp.asarray(t_all), n, beta, 0.5, "normalize"))
    y_clipped = np.asarray(clip_label_norms(jnp.asarray(u_all), jnp.asarray(w), jnp.asarray(y_all), n, bound))
    per_user = np.sqrt(np.bincount(u_all, weights=(w * y_clipped) ** 2, minlength=n))
    assert per_user.max() <= bound * (1 + 1e-5)
    small = np.sqrt(np.bincount(u_all, weights=(w * y_all) ** 2, minlength=n)) < bound
    np.testing.assert_array_equal(y_clipped[small[u_all]], y_all[small[u_all]])
    rep = PrivacyReport(1e-5)
    record_ssp_releases(rep, 1.0, beta, gx, bound / np.sqrt(beta))
    sens_b = rep.releases[1].sensitivity
    assert sens_b == pytest.approx(gx * bound)
    _, b1 = _stacked_gram(t_all, x_all, y_clipped, w, m)
    _, b0 = _stacked_gram(t_all, x_all, y_clipped, np.where(u_all == n - 1, 0.0, w), m)
    db = np.linalg.norm(b1 - b0)
    assert sens_b * (1 - 1e-3) <= db <= sens_b * (1 + 1e-4)


def test_fit_bounds_every_users_label_norm_before_the_ssp_item_update(ratings, monkeypatch):
    """`fit` hands the SSP item update labels with √(Σ_i w_ij² y_ij²) ≤ cfg.label_norm for EVERY user, the bound
    its recorded b release assumes (sensitivity Γx·L), including a user who rates every item at an extreme (residuals at the per-rating clip)."""
    from jdp.altmin import updates as altmin_model
    data = _with_rows(ratings, np.full(ratings.n_items, ratings.n_users), np.arange(ratings.n_items),
                      np.where(np.arange(ratings.n_items) % 2 == 0, 0.5, 5.0), n_users=ratings.n_users + 1)
    seen = []
    original = altmin_model._RidgeItemUpdate.__call__

    def spy(self, v, c, feats, labels, key):
        seen.append((np.asarray(self.weights), np.asarray(labels)))
        return original(self, v, c, feats, labels, key)

    monkeypatch.setattr(altmin_model._RidgeItemUpdate, "__call__", spy)
    for method in ("ada-dpals", "dpals-uniform"):
        model = fit(data, _cfg(method, rating_range=(0.5, 5.0), label_norm=3.0), seed=0)
        cfg = model.config
        assert cfg.label_norm == 3.0 and cfg.label_bound == pytest.approx(3.0 / np.sqrt(cfg.budget))
        b_release = [r for r in model.report.releases if r.name.endswith("b (rhs)")][0]
        assert b_release.sensitivity == pytest.approx(cfg.item_feature_bound * 3.0)
        w, labels = seen[-1]
        per_user = np.sqrt(np.bincount(data.user, weights=(w * labels) ** 2, minlength=data.n_users))
        assert per_user.max() <= 3.0 * (1 + 1e-5)
        assert per_user[-1] == pytest.approx(3.0, rel=1e-4)  # the extreme user sits on the bound


def test_ssp_release_of_an_item_whose_only_user_is_removed_is_still_noise():
    """Removing the only user of an item leaves it without observations. Its release must then be the Gram
    noise alone (keyed by the item's id, so the same draw as with the user present): an exact 0, or a missing
    row, would tell the two neighbours apart. Checked against the noise and the adaptive solve computed
    directly, and the outputs of the neighbours differ for that item only through the user's statistics."""
    from jdp.multitask.ssp import _task_ridge, ridge_solve, ssp_noise, task_weighted_ssp
    from jdp.noise import keyed_gram_noise

    rng = np.random.default_rng(5)
    m, n, d, beta, gx, gy, sigma, lam = 6, 12, 2, 3.0, 1.0, 1.0, 1.0, 2.0
    user, task = np.nonzero(rng.random((n - 1, m - 1)) < 0.6)  # items 0..m-2 rated by users 0..n-2
    user, task = np.r_[user, n - 1], np.r_[task, m - 1]        # item m-1: user n-1 only
    x = rng.normal(size=(user.size, d)).astype(np.float32)
    y = rng.uniform(-gy, gy, user.size).astype(np.float32)
    w = np.full(user.size, 0.5, np.float32)
    key = jax.random.key(7)
    run = lambda keep: np.asarray(task_weighted_ssp(  # noqa: E731
        key, task[keep], user[keep], x[keep], y[keep], w[keep], m, n, beta=beta, clip_x=gx, clip_y=gy,
        noise_multiplier=sigma, lam=lam))
    with_user, without = run(np.ones(user.size, bool)), run(user != n - 1)
    noise = ssp_noise(sigma, beta, gx, gy, lam)
    na, nb = keyed_gram_noise(key, jnp.asarray([m - 1]), d, noise.std_a, noise.std_b)
    ridge = _task_ridge(na, noise.lam, jnp.asarray([0.0, 0.0, 0.0, 1.0, 0.0, 1.0]))
    expected = np.asarray(ridge_solve(na, nb, ridge, adaptive=True))[0]
    np.testing.assert_allclose(without[m - 1], expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(without[m - 1]) > 1e-3)  # noise, not a telltale 0
    assert not np.allclose(with_user[m - 1], without[m - 1])


def test_noisy_gd_worst_case_user_total_gradient_within_recorded_sensitivity():
    """Audit item 1: the user's TOTAL (clipped) gradient in one noisy-GD step, all of its items' features
    aligned, labels and weights maximal, has norm ≤ the recorded sensitivity C (and = C: the bound is
    tight). With unique (task, user) pairs there are no cross terms between tasks and the original
    per-user clip was already exact; a user repeating one item 10x (copies aligned) reached √10·C on
    the original code and must now be rejected."""
    rng = np.random.default_rng(4)
    m, n, d, clip = 15, 25, 3, 0.5
    user, task = np.nonzero(rng.random((n - 1, m)) < 0.4)
    x = rng.normal(size=(user.size, d)).astype(np.float32)
    y = rng.normal(size=user.size).astype(np.float32)
    w = np.ones(user.size, np.float32)
    lr, q = 1.0, 1.0
    e1 = np.zeros(d, np.float32); e1[0] = 1.0
    for label, items in {"all items, aligned": np.arange(m), "one item repeated": np.full(10, 3)}.items():
        cfg = NoisyGDConfig(l2_clip=clip, noise_multiplier=1.0, steps=1, learning_rate=lr, sample_rate=q)
        kw = dict(n_tasks=m, n_users=n, cfg=cfg, clip_x=1.0, clip_y=1.0)
        base = (task, user, x, y, w)
        neighbour = (np.r_[task, items], np.r_[user, np.full(items.size, n - 1)], np.r_[x, np.tile(e1, (items.size, 1))],
                     np.r_[y, np.full(items.size, -1.0, np.float32)], np.r_[w, np.full(items.size, 5.0, np.float32)])
        rep = PrivacyReport(1e-5)
        th0 = np.asarray(task_weighted_noisy_gd(jax.random.key(0), *base, **kw), np.float64)
        try:
            th1 = np.asarray(task_weighted_noisy_gd(jax.random.key(0), *neighbour, **kw, report=rep), np.float64)
        except ValueError as e:
            assert label == "one item repeated" and "duplicate" in str(e)
            continue
        # θ' = θ − lr·(Σ_j clipped G_j + noise)/(q·n) with the same noise: the difference is user j's total
        contribution = np.linalg.norm(th0 - th1) * q * n / lr
        sens = rep.releases[0].sensitivity
        assert contribution <= sens * (1 + 1e-4), (label, contribution, sens)
        assert contribution >= sens * (1 - 1e-3)


def test_noisy_gd_per_item_steps_scale_the_noisy_sum_not_the_sensitivity():
    """The per-item steps of the altmin noisy-GD update (`task_lr`) multiply the NOISY clipped sum, row by row:
    undoing them on neighbouring runs with the same noise leaves the worst-case user's total contribution at
    exactly the recorded sensitivity C, whatever the steps (post-processing of one Gaussian release)."""
    from jdp.multitask import noisy_gd
    rng = np.random.default_rng(5)
    m, n, d, clip = 12, 20, 2, 0.5
    user, task = np.nonzero(rng.random((n - 1, m)) < 0.5)
    x = rng.normal(size=(user.size, d)).astype(np.float32) * 0.3
    y = rng.normal(size=user.size).astype(np.float32) * 0.3
    w = np.ones(user.size, np.float32)
    cfg = NoisyGDConfig(l2_clip=clip, noise_multiplier=1.0, steps=1, learning_rate=1.0)
    task_lr = rng.uniform(0.1, 50.0, m).astype(np.float32)
    e1 = np.array([1.0, 0.0], np.float32)
    items = np.arange(m)  # the added user rates every item, features aligned, labels extreme
    neighbour = (np.r_[task, items], np.r_[user, np.full(m, n - 1)], np.r_[x, np.tile(e1, (m, 1))],
                 np.r_[y, np.full(m, -1.0, np.float32)], np.r_[w, np.ones(m, np.float32)])
    init = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    kw = dict(n_tasks=m, n_users=n, task_lr=task_lr)
    th0 = np.asarray(noisy_gd.run(jax.random.key(3), init, task, user, x, y, w, cfg, **kw), np.float64)
    th1 = np.asarray(noisy_gd.run(jax.random.key(3), init, *neighbour, cfg, **kw), np.float64)
    contribution = np.linalg.norm((th0 - th1) / task_lr[:, None]) * n
    assert contribution == pytest.approx(clip, rel=1e-3)
    assert noisy_gd_releases_sensitivity(cfg) == clip
    with pytest.raises(ValueError, match="task_lr"):
        noisy_gd.run(jax.random.key(3), init, task, user, x, y, w, cfg, n_tasks=m, n_users=n, task_lr=task_lr[:-1])


def noisy_gd_releases_sensitivity(cfg):
    from jdp.multitask.noisy_gd import noisy_gd_releases
    (release,) = noisy_gd_releases(cfg)
    return release.sensitivity


# --------------------------------------------------------------------------------------------------
# Item 6: public sizes and shapes under add/remove-one-user.

def _released_shape(model):
    rep = model.report
    return dict(config=dataclasses.replace(model.config, show_progress=False), shape=model.item_factors.shape,
                noise_multiplier=model.noise_multiplier,
                releases=[(r.name, r.sensitivity, r.noise_scale, r.count, repr(r.event)) for r in rep.releases],
                assumptions=list(rep.assumptions), epsilon=rep.epsilon())


@pytest.mark.parametrize("method", ["ada-dpals", "ada-dpsgd"])
def test_fit_public_sizes_and_hyper_parameters_unchanged_when_one_user_is_added(ratings, method):
    """Audit item 6: dim (default), steps, λ, noise scales, sensitivities, weights' n, item-factor shape and
    the recorded public sizes are the same on neighbouring datasets: one user added with a new id
    beyond the current max, or with an unused id inside the range (sizes = declared id spaces)."""
    declared_users = 400  # public bound: more than the 300 ids in use
    gap = 150  # an id inside the range whose ratings we remove from the base dataset
    base_rows = ratings.user != gap
    base = Interactions(ratings.user[base_rows], ratings.item[base_rows], ratings.rating[base_rows],
                        declared_users, ratings.n_items)
    g = ratings.user == gap
    beyond = _with_rows(base, np.full(g.sum(), 350), ratings.item[g], ratings.rating[g])  # id > current max
    inside = _with_rows(base, ratings.user[g], ratings.item[g], ratings.rating[g])        # id inside the range
    ref = _released_shape(fit(base, _cfg(method)))
    assert ref["shape"] == (ratings.n_items, ref["config"].dim)
    assert any(f"n_users={declared_users}" in a and f"n_items={ratings.n_items}" in a for a in ref["assumptions"])
    for neighbour in (beyond, inside):
        assert _released_shape(fit(neighbour, _cfg(method))) == ref
    # the adaptive weights of the other users do not move either: n of eq. 16 is the declared size
    counts = jnp.asarray(np.bincount(base.item, minlength=base.n_items).astype(np.float32))
    w0 = np.asarray(W.adaptive_weights(counts, jnp.asarray(base.user), jnp.asarray(base.item), base.n_users, 100.0, 0.25))
    w1 = np.asarray(W.adaptive_weights(counts, jnp.asarray(beyond.user), jnp.asarray(beyond.item), beyond.n_users,
                                       100.0, 0.25))
    np.testing.assert_array_equal(w0, w1[: base.nnz])


def test_movielens_declared_sizes_unchanged_when_one_user_is_added(tmp_path):
    """Audit item 6: with a declared user bound and the public item catalogue, the reader's sizes and
    movie indices (the rows of the released item matrix) do not change when one user is added, neither
    with a raw id beyond the max nor inside the range, even if the user rates a movie nobody else rated.
    By default (sizes from the file) they do change, which is why a release must declare them."""
    from jdp.data import load_movielens, load_movielens_items

    rng = np.random.default_rng(5)
    raw_users = np.r_[np.arange(1, 40), np.arange(60, 100)]  # ids 40..59 unused
    rows = [(u, mv, float(rng.integers(1, 6))) for u in raw_users for mv in rng.choice(np.arange(1, 31), 8, replace=False)]
    (tmp_path / "movies.dat").write_text("".join(f"{mv}::Movie {mv} (1999)::Drama\n" for mv in range(1, 41)))
    catalogue = load_movielens_items(tmp_path)
    np.testing.assert_array_equal(catalogue, np.arange(1, 41))

    def write(extra, name):
        path = tmp_path / name
        path.write_text("".join(f"{u}::{mv}::{r:g}::0\n" for u, mv, r in rows + extra))
        return path

    base_path = write([], "base.dat")
    new_user = [(mv, 35.0) for mv in (3, 35)]  # movie 35: in the catalogue, rated by nobody else
    ref = load_movielens(base_path, n_users=200, item_ids=catalogue)
    for raw_id in (500, 50):  # beyond the max raw id / inside the range
        path = write([(raw_id, mv, 4.0) for mv, _ in new_user], f"plus{raw_id}.dat")
        d = load_movielens(path, n_users=200, item_ids=catalogue)
        assert (d.n_users, d.n_items) == (ref.n_users, ref.n_items) == (200, 40)
        np.testing.assert_array_equal(d.item[: ref.nnz], ref.item)  # same movie -> same row of V
        assert load_movielens(path).n_items == ref.n_items - 9  # default: only rated movies get an index...
        assert load_movielens(path).n_users == raw_users.size + 1  # ...and n_users counts the users present
    with pytest.raises(ValueError, match="item_ids"):
        load_movielens(base_path, item_ids=np.arange(1, 10))
    with pytest.raises(ValueError, match="n_users"):
        load_movielens(base_path, n_users=10)


@pytest.mark.slow
def test_cli_declared_sizes_and_duplicates(tmp_path):
    """Audit items 1 and 6 on the command line: a ratings file with a duplicated row is rejected unless
    --merge-duplicates; --n-users / the item catalogue next to the ratings are the report's public
    sizes, and sizes taken from the file are flagged as data-dependent in the output's assumptions."""
    import json

    from jdp.cli import main

    rng = np.random.default_rng(6)
    rows = [(u, mv, int(rng.integers(1, 6))) for u in range(1, 121) for mv in rng.choice(np.arange(1, 41), 10, replace=False)]
    rows.append(rows[3])  # one user repeats one rating
    (tmp_path / "ratings.dat").write_text("".join(f"{u}::{mv}::{r}::0\n" for u, mv, r in rows))
    args = ["altmin", "--data", "movielens", "--data-path", str(tmp_path / "ratings.dat"), "--method", "dpsgd-uniform",
            "--dim", "2", "--steps", "1", "--epsilon", "2"]
    assert main(args) == 2  # duplicate: clean error
    out = tmp_path / "r.json"
    (tmp_path / "movies.dat").write_text("".join(f"{mv}::Movie {mv}::Drama\n" for mv in range(1, 51)))
    assert main(args + ["--merge-duplicates", "--n-users", "1000", "--out", str(out)]) == 0
    assumptions = json.loads(out.read_text())["privacy"]["assumptions"]
    assert any("n_users=1000" in a and "n_items=50" in a for a in assumptions)
    assert not any("data-dependent" in a for a in assumptions)
    assert any("merged" in a for a in assumptions)
    (tmp_path / "movies.dat").unlink()
    assert main(args + ["--merge-duplicates", "--out", str(out)]) == 0
    assumptions = json.loads(out.read_text())["privacy"]["assumptions"]
    assert sum("data-dependent" in a for a in assumptions) == 2


@pytest.mark.parametrize("dim,biases", [(4, True), (0, True), (4, False)])
def test_item_update_features_respect_the_bound_the_accountant_uses(dim, biases):
    """Item biases ride in the item update as a constant feature γ₀: every user's feature x_j = [clip(u_j, Γ), γ₀]
    has norm ≤ √(Γ² + γ₀²) (γ₀ alone at rank 0), the clip_x of the recorded SSP releases, for any u_j, and
    the worst user (norm attained, full budget) moves the A / b stacks by exactly the recorded sensitivities."""
    import math
    from jdp.altmin.model import item_update_features
    cfg = dataclasses.replace(AltMinConfig(method="dpals-uniform", epsilon=1.0, biases=biases), dim=dim).resolve()
    rng = np.random.default_rng(0)
    u = rng.normal(0, 1, (50, dim)) * rng.choice([1e-3, 1.0, 1e3], (50, 1))
    x = np.asarray(item_update_features(u, cfg))
    bound = cfg.item_feature_bound
    assert bound == pytest.approx(0.5 if dim == 0 or not biases else math.hypot(0.5, 0.5))
    assert np.linalg.norm(x, axis=1).max() <= bound * (1 + 1e-6)
    # worst user: k items at weight 1, a feature on the bound, labels at ±Γy -> ‖ΔA‖_F = √k·Γx², ‖Δb‖ = √k·Γx·Γy
    k, gy = cfg.budget, cfg.label_clip
    xw = x[np.argmax(np.linalg.norm(x, axis=1))]
    d_a = math.sqrt(sum(np.sum(np.outer(xw, xw) ** 2) for _ in range(k)))
    d_b = math.sqrt(sum(np.sum((gy * xw) ** 2) for _ in range(k)))
    assert d_a == pytest.approx(math.sqrt(k) * bound**2, rel=1e-5)
    assert d_b == pytest.approx(math.sqrt(k) * bound * gy, rel=1e-5)


# --------------------------------------------------------------------------------------------------
# Rank 0: the Gram (a weighted count) is released once and reused; ada-dpals without counts.

def test_keyed_gram_noise_with_a_gram_key_keys_a_and_b_apart():
    """With `gram_key`, A's noise depends on gram_key only and b's on key only: a fixed gram_key reproduces A's
    noise bit for bit under any step key, while b's noise is fresh each step and not A's draw."""
    from jdp.noise import keyed_gram_noise
    ids, g = jnp.arange(5), jax.random.key(1)
    a1, b1 = keyed_gram_noise(jax.random.key(2), ids, 1, 1.0, 1.0, gram_key=g)
    a2, b2 = keyed_gram_noise(jax.random.key(3), ids, 1, 1.0, 1.0, gram_key=g)
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
    assert not np.allclose(np.asarray(b1), np.asarray(b2))
    assert not np.allclose(np.asarray(a1)[:, 0, 0], np.asarray(b1)[:, 0])
    a3, _ = keyed_gram_noise(jax.random.key(2), ids, 1, 1.0, 1.0, gram_key=jax.random.key(4))
    assert not np.allclose(np.asarray(a1), np.asarray(a3))


@pytest.mark.parametrize("method", ["ada-dpals", "dpals-uniform", "dpals-tail"])
def test_rank0_gram_is_released_once_and_every_step_reuses_it(ratings, method):
    """Rank 0, three steps: the report lists ONE A release (at √(Γb/τ₀)·σ) and three b releases, the
    composition is exactly that, and every step's released Â is bit for bit the first step's (the item update
    checks it) while b̂ moves with the user biases."""
    from jdp.altmin import updates as altmin_model
    from jdp.altmin.model import bias_gram_noise_ratio
    seen = []
    original = altmin_model._RidgeItemUpdate._solve

    def spy(self, feats, classes, key, *prior):
        out = original(self, feats, classes, key, *prior)
        seen.append(np.asarray(altmin_model.take_rows(out, self.flat_index))[:, -2:])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(altmin_model._RidgeItemUpdate, "_solve", spy)
        model = fit(ratings, _cfg(method, dim=0, steps=3), seed=0)
    cfg, rep = model.config, model.report
    a = [r for r in rep.releases if r.name.endswith("A (Gram)")]
    b = [r for r in rep.releases if r.name.endswith("b (rhs)")]
    assert [r.count for r in a] == [1] and [r.count for r in b] == [3]
    ratio = bias_gram_noise_ratio(cfg)
    assert ratio == pytest.approx(np.sqrt(2.0))
    assert a[0].noise_scale == pytest.approx(ratio * model.noise_multiplier * a[0].sensitivity, rel=1e-12)
    pre = [r.composed_event() for r in rep.releases if not r.name.startswith("item update")]
    manual = dp_accounting.ComposedDpEvent(pre + [dp_accounting.GaussianDpEvent(ratio * model.noise_multiplier),
                                                  dp_accounting.SelfComposedDpEvent(
                                                      dp_accounting.GaussianDpEvent(model.noise_multiplier), 3)])
    assert rep.epsilon() == pytest.approx(compute_epsilon(manual, cfg.delta), rel=1e-9)
    assert rep.epsilon() <= cfg.epsilon * (1 + 1e-6)
    counts = [s[:, 0] for s in seen]
    for c in counts[1:]:
        np.testing.assert_array_equal(c, counts[0])
    assert not np.allclose(seen[0][:, 1], seen[-1][:, 1])


def test_popularity_prior_is_post_processing_of_the_same_release():
    """item_bias_mean='popularity' (rank 0) reads only the item update's released (Â, b̂): the report is the zero
    prior's, the first step releases bit for bit the same statistics (same key), and its re-solve with the fitted
    prior mean reads the same release again (no second look at the ratings). With factors it changes nothing."""
    from jdp.altmin import updates as altmin_model
    data = planted_powerlaw(seed=2, n_users=3000, n_items=80, nnz=40_000, rank=3).data
    runs = {}
    original = altmin_model._RidgeItemUpdate._solve
    for mean in ("zero", "popularity"):
        seen = []

        def spy(self, feats, classes, key, prior_last=None):
            out = original(self, feats, classes, key, prior_last)
            seen.append((np.asarray(altmin_model.take_rows(out, self.flat_index))[:, -2:], prior_last is not None))
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(altmin_model._RidgeItemUpdate, "_solve", spy)
            model = fit(data, _cfg("ada-dpals", epsilon=4.0, dim=0, steps=2, item_bias_mean=mean), seed=0)
        runs[mean] = (model, seen)
    (zero, seen_zero), (pop, seen_pop) = runs["zero"], runs["popularity"]
    assert "item_bias_prior_mean_range" in pop.timings and "item_bias_prior_mean_range" not in zero.timings
    assert repr(pop.report.event()) == repr(zero.report.event()) and pop.noise_multiplier == zero.noise_multiplier
    assert pop.report.epsilon() == zero.report.epsilon()
    assert [p for _, p in seen_pop] == [False, True] * 2 and not any(p for _, p in seen_zero)
    np.testing.assert_array_equal(seen_pop[0][0], seen_zero[0][0])  # step 1: the same released statistics
    for step in range(2):  # each re-solve reads its step's release
        np.testing.assert_array_equal(seen_pop[2 * step + 1][0], seen_pop[2 * step][0])
    assert not np.allclose(pop.item_bias, zero.item_bias)
    with_factors = [fit(data, _cfg("ada-dpals", epsilon=4.0, dim=2, steps=1, item_bias_mean=mean), seed=0)
                    for mean in ("zero", "popularity")]
    np.testing.assert_array_equal(with_factors[0].item_bias, with_factors[1].item_bias)


def test_noisy_gd_adaptive_weights_read_released_counts_through_their_posterior(ratings):
    """ada-dpsgd may release counts for its step caps alone, at a noise far above the counts: its weights then read
    the posterior effective counts (E[n^(−μ) | n̂])^(−1/μ) under the public prior (post-processing of the release,
    pulled together where the noise is large), the plug-in n̂ where the noise is small; the step caps use the same
    ω_i as the weights (they bound w_ij by ω_i)."""
    from jdp.altmin import updates as altmin_model
    seen, released = [], []
    original_weights, original_counts = altmin_model.adaptive_weights, altmin_model.private_counts

    def spy_weights(counts, *args, **kwargs):
        seen.append(None if counts is None else np.asarray(counts, np.float64))
        return original_weights(counts, *args, **kwargs)

    def spy_counts(*args, **kwargs):
        out = original_counts(*args, **kwargs)
        released.append(np.asarray(out.counts, np.float64))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(altmin_model, "adaptive_weights", spy_weights)
        mp.setattr(altmin_model, "private_counts", spy_counts)
        for eps in (0.2, 200.0):
            cfg = _cfg("ada-dpsgd", epsilon=eps, count_release=True)
            plan = plan_run(cfg, ratings.n_users, ratings.n_items)
            model = fit(ratings, cfg, seed=0)
            assert "item counts" in [r.name for r in model.report.releases]
            raw, used = released[-1], seen[-1]
            assert used is not None and np.all((used >= 1 - 1e-3) & (used <= ratings.n_users * (1 + 1e-3)))
            std = plan.noise.counts * np.sqrt(plan.config.budget)
            small = std <= 0.05 * raw
            if eps == 200.0:
                assert small.mean() > 0.5
                np.testing.assert_allclose(used[small], raw[small], rtol=1e-3)  # plug-in where the noise is small
            else:
                assert not small.any()
                assert np.std(np.log(used)) < 0.5 * np.std(np.log(raw))  # pulled together by the prior
            counts = np.full(ratings.n_items, 50.0, np.float32)
            update = altmin_model._NoisyGDItemUpdate(ratings, np.ones(ratings.nnz, np.float32), plan.config,
                                                     plan.noise, {}, counts)
            omega = altmin_model.adaptive_item_weights(altmin_model._weight_counts(counts, plan.config, plan.noise,
                                                                                   ratings), plan.config, ratings.n_users)
            np.testing.assert_allclose(update.task_lr, altmin_model.item_step_sizes(
                plan.config, plan.noise, counts, ratings.n_users, ratings.n_items, omega))


def test_rank0_item_update_refuses_a_changed_gram(ratings):
    """Reusing A's noise is only private while A is unchanged: if a later step's Gram differed (here: the
    constant feature changed), the item update raises instead of releasing A again under the same noise."""
    from jdp.altmin import updates as altmin_model
    cfg = plan_run(_cfg("dpals-uniform", dim=0, steps=2), ratings.n_users, ratings.n_items).config
    plan = plan_run(cfg, ratings.n_users, ratings.n_items)
    weights = np.ones(ratings.nnz, np.float32) * 0.5
    update = altmin_model._RidgeItemUpdate(ratings, weights, cfg, plan.noise, {}, gram_key=jax.random.key(9))
    feats = jnp.full((ratings.n_users, 1), cfg.bias_clip, jnp.float32)
    labels = jnp.asarray(np.clip(ratings.rating - 3.0, -1, 1), jnp.float32)
    v, c = jnp.zeros((ratings.n_items, 0)), jnp.zeros(ratings.n_items)
    update(v, c, feats, labels, jax.random.key(1))
    update(v, c, feats, 0.5 * labels, jax.random.key(2))  # new labels: fine (b is released each step)
    with pytest.raises(RuntimeError, match="changed between steps"):
        update(v, c, 2 * feats, labels, jax.random.key(3))


@pytest.mark.parametrize("method", ["ada-dpals", "ada-dpsgd", "dpsgd-uniform"])
def test_methods_without_useful_counts_release_none_and_read_none(ratings, method):
    """When the counts would be of no use (noise above the mean public count; for noisy GD also no step cap that
    needs them), a method whose count release is optional releases no counts (the report has no 'item counts',
    all of ε goes to the item update) and never computes them; adaptive weights are then ω_i = 1 clipped per
    user, within the budget. At large ε the counts are released as before."""
    from jdp.altmin import updates as altmin_model
    calls = []
    original = altmin_model.private_counts

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(altmin_model, "private_counts", spy)
        low = fit(ratings, _cfg(method, epsilon=0.2), seed=0)
        assert not low.config.count_release and not calls
        assert "item counts" not in [r.name for r in low.report.releases]
        assert any("without item counts" in a for a in low.report.assumptions)
        assert low.report.epsilon() == pytest.approx(0.2, rel=1e-3)
        high = fit(ratings, _cfg(method, epsilon=200.0), seed=0)
        assert high.config.count_release and calls
        assert "item counts" in [r.name for r in high.report.releases]
    w = np.asarray(W.adaptive_weights(None, jnp.asarray(ratings.user), jnp.asarray(ratings.item), ratings.n_users,
                                      100.0, 0.25, n_tasks=ratings.n_items))
    ref = np.asarray(W.clip_user_weights(jnp.ones(ratings.n_items), jnp.asarray(ratings.user),
                                         jnp.asarray(ratings.item), ratings.n_users, 100.0))
    np.testing.assert_array_equal(w, ref)
    assert np.bincount(ratings.user, weights=w.astype(np.float64) ** 2).max() <= 100.0
    for bad in (dict(method="dpals-uniform", count_release=True), dict(method="dpsgd-tail", count_release=False),
                dict(method=method, count_release="no")):
        with pytest.raises(ValueError, match="count_release"):
            AltMinConfig(epsilon=1.0, **bad).resolve()
    with pytest.raises(ValueError, match="n_tasks"):
        W.adaptive_weights(None, jnp.asarray(ratings.user), jnp.asarray(ratings.item), ratings.n_users, 100.0, 0.25)


def test_user_side_solves_read_only_the_users_own_ratings(ratings):
    """Predictions' user-side solves (u_j, b_j and the item-bias scale a_j) are post-processing of the release and
    user j's OWN ratings: giving every other user worst-case ratings (each flipped to the other end of the scale)
    leaves user j's solution unchanged."""
    model = fit(ratings, AltMinConfig(method="ada-dpals", epsilon=5.0, show_progress=False), seed=0)
    assert model.config.user_slope_reg < np.inf and np.abs(model.item_bias).max() > 0
    lo, hi = model.config.rating_range
    j = int(ratings.user[0])
    flipped = np.where(ratings.user == j, ratings.rating, lo + hi - ratings.rating).astype(np.float32)
    other = Interactions(ratings.user, ratings.item, flipped, ratings.n_users, ratings.n_items)
    mine, theirs = model.user_factors(ratings), model.user_factors(other)
    np.testing.assert_array_equal(mine.slope[j], theirs.slope[j])
    np.testing.assert_array_equal(mine.bias[j], theirs.bias[j])
    np.testing.assert_array_equal(mine.factors[j], theirs.factors[j])
    assert not np.allclose(mine.slope, theirs.slope)  # the others' solutions did change
