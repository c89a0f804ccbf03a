"""Adversarial sensitivity search for the user-level releases of jdp.multitask and jdp.altmin.

Unit of privacy: a user; neighbours add or remove all rows of one user. For every release the search crafts ONE
user's rows (ratings / labels at ±1e6, 1e-6, 3e38 and denormal scales, near-cancelling values, the user's rows
on many or all tasks, features aligned or at extreme norms, weights at the edge of the checked budget or, where
nothing bounds them, at 1e-6 … 3e38, model parameters at extreme scales), with random restarts and, where the
summed quantity is differentiable, a few steps of gradient ascent (jax.grad) on a float32 surrogate of the user's
contribution. Each candidate is then run through the REAL routine twice (with and without the user) and the
noise-free sum the routine hands to its noise step, in float32 as computed, is compared with the sensitivity the
routine records: ‖sum(D) − sum(D without the user)‖ ≤ sensitivity·(1 + 1e-5) + slack, where slack is the
recursive-summation error bound of the OTHER users' float32 sum (2·n·u·Σ|terms| per entry, u = 2⁻²⁴, both
neighbours), an absolute term that does not depend on the crafted user. Invalid rows (NaN/inf values, duplicate
pairs, ids outside the declared id spaces) must raise ValueError before anything is released.

The default run uses a small budget of restarts; `-m slow` runs a larger one.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.accounting import PrivacyReport
from jdp.altmin import AltMinConfig, Method, fit
from jdp.altmin import updates as altmin_model
from jdp.data import Interactions
from jdp.multitask import counts as counts_mod
from jdp.multitask import gram, noisy_gd
from jdp.multitask import ssp as ssp_mod
from jdp.multitask.noisy_gd import NoisyGDConfig, task_weighted_noisy_gd
from jdp.multitask.ssp import clip_label_norms, task_weighted_ssp

U32 = 2.0 ** -24  # float32 unit roundoff
REL = 1e-5        # relative tolerance on every sensitivity
FAST, SLOW = 4, 100  # random restarts per routine: default run / -m slow
# (restarts, seed) of each search: a small budget in the default suite, a larger one in the slow suite
BUDGETS = pytest.mark.parametrize("restarts, seed", [(FAST, 0), pytest.param(SLOW, 1, marks=pytest.mark.slow)])
WORST = {}  # routine -> worst ratio found (printed with -s)


def _record(name, ratio):
    WORST[name] = max(WORST.get(name, 0.0), float(ratio))


def _scale(rng, size=None):
    """Random magnitudes 10^U(−6, 6), now and then 3e38 / denormal / exactly 0 / one-ulp-from-1."""
    s = 10.0 ** rng.uniform(-6, 6, size)
    special = rng.choice([3e38, 1e-45, 0.0, np.nextafter(np.float32(1), np.float32(2)), 1e6, 1e-6], size)
    return np.where(rng.random(size) < 0.2, special, s)


def _signed(rng, size):
    return _scale(rng, size) * rng.choice([-1.0, 1.0], size)


def _near_cancelling(rng, size, big=1e6):
    """±big pairs that almost cancel, plus tiny residues: the float32 sum loses everything but the residues."""
    v = np.tile([big, -big], size // 2 + 1)[:size] + rng.normal(size=size) * 1e-6
    return v.astype(np.float32)


# --------------------------------------------------------------------------------------------------
# Pre-processing counts (`jdp.multitask.counts`): the noise step's input is captured, the noise skipped.
@pytest.fixture
def counts_spy(monkeypatch):
    seen = []

    def capture(key, value, std):
        seen.append(np.asarray(value, np.float64))
        return value

    monkeypatch.setattr(counts_mod, "gaussian_histogram", capture)
    monkeypatch.setattr(counts_mod, "add_gaussian", capture)
    return seen


def _counts_attack(counts_spy, restarts, seed):
    rng = np.random.default_rng(seed)
    m, n, cs = 24, 30, 4
    # other users: ≤ cs rows each, so every one of their rows is kept whatever the subsample (the neighbours then
    # differ by the crafted user alone)
    others_u = np.repeat(np.arange(n - 1), 1 + np.arange(n - 1) % cs)
    others_i = np.concatenate([rng.choice(m, c, replace=False) for c in 1 + np.arange(n - 1) % cs])
    others_y = np.where(np.arange(others_u.size) % 2 == 0, 1.0, -1.0) * 2.0  # at ±bound: near-cancelling total
    bound = 2.0
    for r in range(restarts):
        rows = int(rng.integers(1, m + 1)) if r else m  # restart 0: every task
        items = rng.choice(m, rows, replace=False)
        y = [_signed(rng, rows), _near_cancelling(rng, rows), np.full(rows, 3e38), np.full(rows, -1e-45)][r % 4]
        u_all, i_all = np.r_[others_u, np.full(rows, n - 1)], np.r_[others_i, items]
        y_all = np.r_[others_y, y].astype(np.float32)
        counts_spy.clear()
        rep = PrivacyReport(1e-5)
        counts_mod.private_counts(jax.random.key(r), jnp.asarray(u_all), jnp.asarray(i_all), m, cs, 1.0, rep)
        counts_mod.private_counts(jax.random.key(r), jnp.asarray(others_u), jnp.asarray(others_i), m, cs, 1.0)
        counts_mod.private_label_sum(jax.random.key(r), jnp.asarray(u_all), jnp.asarray(y_all), bound, cs, 1.0, rep)
        counts_mod.private_label_sum(jax.random.key(r), jnp.asarray(others_u), jnp.asarray(others_y, np.float32),
                                     bound, cs, 1.0)
        counts_mod.private_total_count(jax.random.key(r), jnp.asarray(u_all), n, cs, 1.0, rep)
        counts_mod.private_total_count(jax.random.key(r), jnp.asarray(others_u), n, cs, 1.0)
        c1, c0, s1, n1, s0, n0, t1, t0 = counts_spy
        sens_c, sens_s, sens_n, sens_t = (rel.sensitivity for rel in rep.releases)
        # the other users' label sum in float32: |fl(Σ) − Σ| ≤ N·u·Σ|y| for each neighbour (N rows)
        slack = 2 * u_all.size * U32 * np.abs(others_y).sum()
        for name, diff, sens, extra in (("private_counts", np.linalg.norm(c1 - c0), sens_c, 0.0),
                                        ("private_label_sum (sum)", abs(s1 - s0), sens_s, slack),
                                        ("private_label_sum (count)", abs(n1 - n0), sens_n, 0.0),
                                        ("private_total_count", abs(t1 - t0), sens_t, 0.0)):
            _record(name, diff / sens)
            assert diff <= sens * (1 + REL) + extra, (name, r, diff, sens)
    for name in ("private_counts", "private_label_sum (count)", "private_total_count"):
        assert WORST[name] >= 1 - 1e-6, name  # the bound is attained: the search reaches the worst case


@BUDGETS
def test_counts_and_label_sums_adversarial(counts_spy, restarts, seed):
    _counts_attack(counts_spy, restarts, seed)


def test_counts_refuse_invalid_rows_before_releasing(counts_spy):
    u, i = jnp.asarray([0, 1, 2]), jnp.asarray([0, 1, 1])
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="label"):
            counts_mod.private_label_sum(jax.random.key(0), u, jnp.asarray([1.0, bad, 0.0]), 1.0, 2, 1.0)
        with pytest.raises(ValueError, match="label"):
            counts_mod.private_mean(jax.random.key(0), u, jnp.asarray([1.0, bad, 0.0]), 1.0, 2, 1.0)
    for items, match in (([0, 1, 3], "item ids"), ([0, -1, 1], "non-negative"), ([0, 1, 1, 1], "duplicate")):
        users = jnp.asarray([0, 1, 2, 2][: len(items)])
        with pytest.raises(ValueError, match=match):
            counts_mod.private_counts(jax.random.key(0), users, jnp.asarray(items), 3, 2, 1.0)
    with pytest.raises(ValueError, match="user ids"):
        counts_mod.private_total_count(jax.random.key(0), jnp.asarray([0, 5]), 5, 2, 1.0)
    assert counts_spy == []  # nothing reached the noise step


# --------------------------------------------------------------------------------------------------
# Task-weighted SSP (`jdp.multitask.ssp`): the Gram / rhs stacks that `solve_tasks` perturbs, from its own inputs.
_class_gram = jax.jit(gram.class_gram)


def _stacks(feats, classes, class_tasks, n_tasks):
    """Per task A_i [m, d, d] and b_i [m, d] exactly as the engine sums them (float32 `gram.class_gram`)."""
    d = feats.shape[1]
    a_all, b_all = np.zeros((n_tasks + 1, d, d)), np.zeros((n_tasks + 1, d))
    for (src, sw, lab), tasks in zip(classes, class_tasks):
        for p in range(src.shape[0]):
            a, b = _class_gram(feats, src[p], sw[p], lab[p])
            np.add.at(a_all, np.asarray(tasks[p]), np.asarray(a, np.float64))  # one row per task: exact
            np.add.at(b_all, np.asarray(tasks[p]), np.asarray(b, np.float64))
    return a_all[:n_tasks], b_all[:n_tasks]


@pytest.fixture
def solve_spy(monkeypatch):
    """Captures the private `solve_tasks` calls of task_weighted_ssp and of the altmin item update."""
    seen = []

    def spy(original):
        def capture(feats, classes, class_tasks, stack_index, *args, **kwargs):
            if kwargs.get("noisy", True):
                seen.append((feats, classes, class_tasks))
            return original(feats, classes, class_tasks, stack_index, *args, **kwargs)
        return capture

    monkeypatch.setattr(ssp_mod, "solve_tasks", spy(ssp_mod.solve_tasks))
    monkeypatch.setattr(altmin_model, "solve_tasks", spy(altmin_model.solve_tasks))
    return seen


def _summed_abs(task, x, y, w, m, gx, gy):
    """Σ over rows of |w x xᵀ| and |w y x| per task (float64, after the clips): the scale of the float32 sums."""
    x = np.asarray(x, np.float64)
    x = x * np.minimum(1.0, gx / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300))
    y = np.clip(np.asarray(y, np.float64), -gy, gy)
    sa = np.zeros((m,) + x.shape[1:] * 2)
    sb = np.zeros((m, x.shape[1]))
    np.add.at(sa, task, np.abs(w)[:, None, None] * np.abs(x[:, :, None] * x[:, None, :]))
    np.add.at(sb, task, np.abs(w * y)[:, None] * np.abs(x))
    return sa, sb


def _ssp_surrogate_ascent(rng, t, d, beta, gx, gy, steps=15):
    """Gradient ascent (jax.grad, float32) on the crafted user's features, labels and weight direction of the
    SSP contribution ‖ΔA‖/sens_A + ‖Δb‖/sens_b, weights kept at the budget (w = √β·|v|/‖v‖)."""
    def contribution(params):
        x, y, v = params
        xc = x * jnp.minimum(1.0, gx / jnp.maximum(jnp.linalg.norm(x, axis=1, keepdims=True), 1e-12))
        yc = jnp.clip(y, -gy, gy)
        w = jnp.sqrt(beta) * jnp.abs(v) / jnp.linalg.norm(v)
        a = jnp.sqrt(jnp.sum(w**2 * jnp.sum(xc**2, 1) ** 2))
        b = jnp.sqrt(jnp.sum(w**2 * yc**2 * jnp.sum(xc**2, 1)))
        return a / (jnp.sqrt(beta) * gx**2) + b / (jnp.sqrt(beta) * gx * gy)

    params = (jnp.asarray(rng.normal(size=(t, d)) * 0.3 * gx, jnp.float32),
              jnp.asarray(rng.normal(size=t) * 0.3 * gy, jnp.float32), jnp.asarray(rng.random(t) + 0.1, jnp.float32))
    grad = jax.jit(jax.grad(contribution))
    for _ in range(steps):
        g = grad(params)
        params = tuple(p + 0.5 * gi / (jnp.linalg.norm(gi) + 1e-12) * jnp.linalg.norm(p) for p, gi in zip(params, g))
    x, y, v = (np.asarray(p) for p in params)
    return x, y, np.sqrt(beta) * np.abs(v) / np.linalg.norm(v)


def _ssp_attack(solve_spy, restarts, seed):
    rng = np.random.default_rng(seed)
    m, n, d, beta, gx, gy = 12, 20, 3, 4.0, 1.5, 2.0
    user, task = np.nonzero(rng.random((n - 1, m)) < 0.5)
    # other users: features at the clip, labels ±1e6 alternating (clipped to ±Γy: near-cancelling rhs sums)
    x = rng.normal(size=(user.size, d)).astype(np.float32) * 1e3
    y = np.where(np.arange(user.size) % 2 == 0, 1e6, -1e6).astype(np.float32)
    w = np.full(user.size, np.float32(np.sqrt(beta / m)))
    rep = PrivacyReport(1e-5)
    ssp_mod.record_ssp_releases(rep, 1.0, beta, gx, gy)
    sens_a, sens_b = (r.sensitivity for r in rep.releases)
    kw = dict(n_tasks=m, n_users=n, beta=beta, clip_x=gx, clip_y=gy, noise_multiplier=1.0, lam=1.0)
    worst = (0.0, 0.0)
    for r in range(restarts):
        t = m if r < 2 else int(rng.integers(1, m + 1))
        items = rng.choice(m, t, replace=False)
        kind = r % 4
        if kind == 0:  # gradient ascent on a float32 surrogate, then the real routine
            xu, yu, wu = _ssp_surrogate_ascent(rng, t, d, beta, gx, gy)
        else:
            direction = rng.normal(size=d) if kind == 1 else rng.normal(size=(t, d))  # aligned or not
            xu = np.clip(np.broadcast_to(direction, (t, d)) * _scale(rng, (t, 1)) * rng.choice([-1, 1], (t, 1)),
                         -3e38, 3e38)  # finite in float32
            yu = _signed(rng, t) if kind != 3 else _near_cancelling(rng, t)
            wu = np.abs(_scale(rng, t)) + 1e-30
        # weights at the edge of the budget check: Σ w² = β, or β·(1 + 0.99e-5) (its tolerance)
        edge = 1 + (0.99e-5 if rng.random() < 0.5 else 0.0)
        wu = (wu / np.sqrt(np.sum(np.asarray(wu, np.float64) ** 2)) * np.sqrt(beta * edge)).astype(np.float32)
        while np.sum(wu.astype(np.float64) ** 2) > beta * (1 + 1e-5):  # float32 rounding up: one ulp down
            wu = np.nextafter(wu, np.float32(0))
        args = (np.r_[task, items], np.r_[user, np.full(t, n - 1)], np.r_[x, np.asarray(xu, np.float32)],
                np.r_[y, np.asarray(yu, np.float32)], np.r_[w, wu])
        solve_spy.clear()
        task_weighted_ssp(jax.random.key(r), *args, **kw)
        task_weighted_ssp(jax.random.key(r), task, user, x, y, w, **kw)
        (a1, b1), (a0, b0) = (_stacks(*seen, m) for seen in solve_spy)
        sa, sb = _summed_abs(task, x, y, w, m, gx, gy)
        rows = np.bincount(args[0], minlength=m).max()
        slack_a, slack_b = (2 * rows * U32 * np.linalg.norm(s) for s in (sa, sb))  # the others' float32 sums
        da, db = np.linalg.norm(a1 - a0), np.linalg.norm(b1 - b0)
        worst = (max(worst[0], da / sens_a), max(worst[1], db / sens_b))
        assert da <= sens_a * (1 + REL) + slack_a, (r, da / sens_a, slack_a / sens_a)
        assert db <= sens_b * (1 + REL) + slack_b, (r, db / sens_b, slack_b / sens_b)
    _record("task_weighted_ssp A", worst[0])
    _record("task_weighted_ssp b", worst[1])
    assert min(worst) >= 1 - 1e-3  # the search reaches the bound


@BUDGETS
def test_ssp_statistics_adversarial(solve_spy, restarts, seed):
    _ssp_attack(solve_spy, restarts, seed)


def test_ssp_refuses_invalid_rows_before_releasing(solve_spy):
    task, user = np.array([0, 1, 1]), np.array([0, 0, 1])
    x, y, w = np.ones((3, 2), np.float32), np.ones(3, np.float32), np.full(3, 0.5, np.float32)
    kw = dict(n_tasks=2, n_users=2, beta=1.0, clip_x=1.0, clip_y=1.0, noise_multiplier=1.0, lam=1.0)

    def run(**over):
        a = {**dict(task=task, user=user, x=x, y=y, weights=w), **over}
        return task_weighted_ssp(jax.random.key(0), a["task"], a["user"], a["x"], a["y"], a["weights"], **kw)

    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="finite"):
            run(x=np.where(np.arange(6).reshape(3, 2) == 3, bad, x).astype(np.float32))
        with pytest.raises(ValueError, match="finite"):
            run(y=np.array([1.0, bad, 0.0], np.float32))
        with pytest.raises(ValueError, match="weights"):
            run(weights=np.array([0.5, bad, 0.5], np.float32))
    with pytest.raises(ValueError, match="weights"):
        run(weights=np.array([0.5, -0.5, 0.5], np.float32))
    with pytest.raises(ValueError, match="budget"):
        run(weights=np.array([0.8, 0.8, 0.5], np.float32))  # user 0: Σ w² = 1.28 > β
    with pytest.raises(ValueError, match="duplicate"):
        run(task=np.array([1, 1, 0]))
    with pytest.raises(ValueError, match="user ids"):
        run(user=np.array([0, 0, 2]))  # the padding id n_users
    with pytest.raises(ValueError, match="task ids"):
        run(task=np.array([0, 1, 2]))  # the padding id n_tasks
    assert solve_spy == []


def _label_norm_attack(restarts, seed):
    """`clip_label_norms` (per-user bound L on √Σ_i w_ij² y_ij²) on crafted labels and weights: every user's
    clipped norm ≤ L, and the rhs contribution through the Gram engine ≤ Γx·L, the recorded b sensitivity."""
    rng = np.random.default_rng(seed)
    m, n, d, beta, gx, bound = 10, 16, 2, 9.0, 1.5, 3.0
    worst = 0.0
    for r in range(restarts):
        user, task = np.nonzero(rng.random((n, m)) < 0.6)
        labels = np.where(user == n - 1, _signed(rng, user.size) if r % 2 else _near_cancelling(rng, user.size),
                          rng.normal(size=user.size) * 1e3).astype(np.float32)
        w = np.abs(_scale(rng, user.size)).astype(np.float32)
        w /= np.sqrt(np.bincount(user, weights=w.astype(np.float64) ** 2, minlength=n))[user] / np.sqrt(beta)
        w = w.astype(np.float32)
        clipped = np.asarray(clip_label_norms(jnp.asarray(user), jnp.asarray(w), jnp.asarray(labels), n, bound))
        assert np.all(np.isfinite(clipped))
        norm = np.sqrt(np.bincount(user, weights=(w.astype(np.float64) * clipped) ** 2, minlength=n))
        assert norm.max() <= bound * (1 + REL), (r, norm.max() / bound)
        e = np.zeros(d, np.float32); e[0] = gx
        feats = np.tile(e, (user.size, 1))  # every user's features aligned at the clip
        b = []
        for keep in (np.ones(user.size, bool), user != n - 1):
            plan = gram.build_plan(task[keep], np.arange(keep.sum()), w[keep], m)
            classes, si = gram.device_arrays(plan, plan.slot_values(clipped[keep]))
            b.append(np.asarray(gram.gram_unsharded(jnp.asarray(feats[keep]), classes, si)[1], np.float64)[plan.flat_index])
        sb = np.zeros((m, d))
        np.add.at(sb, task, np.abs(w * clipped)[:, None] * np.abs(feats))
        slack = 2 * n * U32 * np.linalg.norm(sb)
        db = np.linalg.norm(b[0] - b[1])
        worst = max(worst, db / (gx * bound))
        assert db <= gx * bound * (1 + REL) + slack, (r, db / (gx * bound))
    _record("clip_label_norms (rhs)", worst)
    assert worst >= 1 - 1e-3


@BUDGETS
def test_label_norm_clip_adversarial(restarts, seed):
    _label_norm_attack(restarts, seed)


# --------------------------------------------------------------------------------------------------
# Task-weighted noisy GD (`jdp.multitask.noisy_gd`): the clipped gradient sum of one step, captured in the
# compiled step itself (the noise step replaced by a callback that records its input).
@pytest.fixture
def gradient_spy(monkeypatch):
    seen = []

    def capture(key, value, std):
        jax.debug.callback(lambda v: seen.append(np.asarray(v, np.float64)), value)
        return value

    monkeypatch.setattr(noisy_gd, "add_gaussian", capture)
    noisy_gd._run.clear_cache()  # retrace with the spy
    yield seen
    monkeypatch.undo()
    noisy_gd._run.clear_cache()  # and without it for the tests that follow


def _noisy_gd_surrogate_ascent(rng, init, t_items, x, y, w, steps=10):
    """Gradient ascent on the public parameters θ and the user's labels of the UNCLIPPED gradient norm (the
    clip then has the most to cut)."""
    def norm(params):
        theta, yy = params
        resid = jnp.einsum("nd,nd->n", theta[t_items], x) - yy
        return jnp.sqrt(jnp.sum(((w * resid)[:, None] * x) ** 2))

    params = (jnp.asarray(init), jnp.asarray(y))
    grad = jax.jit(jax.grad(norm))
    for _ in range(steps):
        g = grad(params)
        params = tuple(p + gi / (jnp.linalg.norm(gi) + 1e-12) * (1 + jnp.linalg.norm(p)) for p, gi in zip(params, g))
    return np.asarray(params[0]), np.asarray(params[1])


def _noisy_gd_attack(gradient_spy, restarts, seed):
    rng = np.random.default_rng(seed)
    m, n, d, clip = 8, 12, 3, 0.5
    user, task = np.nonzero(rng.random((n - 1, m)) < 0.5)
    x = rng.normal(size=(user.size, d)).astype(np.float32)
    y = rng.normal(size=user.size).astype(np.float32) * 1e6
    w = rng.uniform(0.5, 2.0, user.size).astype(np.float32)
    cfg = NoisyGDConfig(l2_clip=clip, noise_multiplier=1.0, steps=1, learning_rate=1.0)
    worst = 0.0
    for r in range(restarts):
        t = m if r < 2 else int(rng.integers(1, m + 1))
        items = rng.choice(m, t, replace=False)
        init = (rng.normal(size=(m, d)) * _scale(rng, (m, 1))).astype(np.float32)
        xu = (np.broadcast_to(rng.normal(size=d), (t, d)) if r % 2 else rng.normal(size=(t, d))) * _scale(rng, (t, 1))
        yu = _signed(rng, t) if r % 3 else _near_cancelling(rng, t)
        wu = _signed(rng, t) * (1e32 if r % 5 == 4 else 1.0)  # weights are not budgeted here: anything finite
        xu, wu = np.clip(xu, -3e38, 3e38), np.clip(wu, -3e38, 3e38)
        xu, yu, wu = (np.asarray(v, np.float32) for v in (xu, yu, wu))
        if r % 4 == 0:
            xc = np.asarray(noisy_gd.clip_by_norm(jnp.asarray(xu), 1.0))
            init, yu = _noisy_gd_surrogate_ascent(rng, init, items, xc, np.clip(yu, -1e3, 1e3), wu)
            init, yu = init.astype(np.float32), np.clip(np.nan_to_num(yu), -3e38, 3e38).astype(np.float32)
        init = np.where(np.isfinite(init), init, 0.0).astype(np.float32)
        kw = dict(n_tasks=m, n_users=n, cfg=cfg, clip_x=1.0, clip_y=1e3, init=jnp.asarray(init))
        gradient_spy.clear()
        task_weighted_noisy_gd(jax.random.key(r), np.r_[task, items], np.r_[user, np.full(t, n - 1)],
                               np.r_[x, xu], np.r_[y, yu], np.r_[w, wu], **kw)
        task_weighted_noisy_gd(jax.random.key(r), task, user, x, y, w, **kw)
        g1, g0 = gradient_spy
        # the other users' sum: each clipped contribution has norm ≤ C, so Σ_j |entries| ≤ (n − 1)·C in Frobenius
        slack = 2 * (n - 1) * U32 * (n - 1) * clip
        if not (np.all(np.isfinite(g0)) and np.all(np.isfinite(g1))):
            # a NaN/inf in the released sum would reveal the user; it must come from the public θ alone, on both
            assert np.array_equal(np.isfinite(g0), np.isfinite(g1)), r
            continue
        diff = np.linalg.norm(g1 - g0)
        worst = max(worst, diff / clip)
        assert diff <= clip * (1 + REL) + slack, (r, diff / clip)
    _record("task_weighted_noisy_gd step", worst)
    assert worst >= 1 - 1e-4


@BUDGETS
def test_noisy_gd_step_adversarial(gradient_spy, restarts, seed):
    _noisy_gd_attack(gradient_spy, restarts, seed)


def test_noisy_gd_overflowing_user_contributes_zero_not_nan(gradient_spy):
    """A finite but huge weight (3e38) makes w·resid overflow float32: the user's gradient is inf/NaN. It used to
    reach the released sum as NaN (0·inf), which only its presence could cause: it must contribute 0 instead."""
    cfg = NoisyGDConfig(l2_clip=1.0, noise_multiplier=1.0, steps=1, learning_rate=1.0)
    x = np.array([[1.0, 0.0], [0.6, 0.8], [1.0, 0.0]], np.float32)
    init = jnp.full((2, 2), 10.0)
    kw = dict(n_tasks=2, n_users=3, cfg=cfg, clip_x=1.0, clip_y=1.0, init=init)
    task_weighted_noisy_gd(jax.random.key(0), np.array([0, 1, 1]), np.array([0, 1, 2]), x, np.ones(3, np.float32),
                           np.array([1.0, 1.0, 3e38], np.float32), **kw)
    task_weighted_noisy_gd(jax.random.key(0), np.array([0, 1]), np.array([0, 1]), x[:2], np.ones(2, np.float32),
                           np.ones(2, np.float32), **kw)
    with_user, without = gradient_spy
    assert np.all(np.isfinite(with_user))
    np.testing.assert_array_equal(with_user, without)


def test_noisy_gd_refuses_invalid_rows(gradient_spy):
    cfg = NoisyGDConfig(l2_clip=1.0, noise_multiplier=1.0, steps=1, learning_rate=1.0)
    task, user = np.array([0, 1, 1]), np.array([0, 0, 1])
    x, y, w = np.ones((3, 2), np.float32), np.ones(3, np.float32), np.ones(3, np.float32)
    kw = dict(n_tasks=2, n_users=2, cfg=cfg, clip_x=1.0, clip_y=1.0)
    for bad in (np.nan, np.inf):
        for arrays in ((x * np.float32(bad), y, w), (x, np.array([1, bad, 1], np.float32), w),
                       (x, y, np.array([1, 1, bad], np.float32))):
            with pytest.raises(ValueError, match="finite"):
                task_weighted_noisy_gd(jax.random.key(0), task, user, *arrays, **kw)
    for t, u, match in ((np.array([1, 1, 0]), user, "duplicate"), (task, np.array([0, 0, 2]), "user ids"),
                        (np.array([0, 1, 2]), user, "task ids")):
        with pytest.raises(ValueError, match=match):
            task_weighted_noisy_gd(jax.random.key(0), t, u, x, y, w, **kw)
    assert gradient_spy == []


# --------------------------------------------------------------------------------------------------
# altmin fit: the first private item update's summed statistics (SSP) / clipped gradient (noisy GD), for a
# crafted user's ratings, against the sensitivities the fit's report records.
def _altmin_data(rng, rating_range, n_users=24, n_items=10, k=4):
    """Other users: k − 1 < k items each, so their weights are 1 whatever the allocation and they keep every rating
    (the neighbours differ by the crafted user only; count_release=False: nothing noisy feeds the weights)."""
    lo, hi = rating_range
    user = np.repeat(np.arange(n_users - 1), k - 1)
    item = np.concatenate([rng.choice(n_items, k - 1, replace=False) for _ in range(n_users - 1)])
    rating = rng.uniform(lo, hi, user.size)
    return user, item, rating


def _crafted_ratings(rng, r, n_items, rating_range):
    lo, hi = rating_range
    kind = r % 4
    if kind == 0:
        return np.where(np.arange(n_items) % 2 == 0, lo, hi)  # alternating extremes: residuals at the clip
    if kind == 1:
        return np.full(n_items, hi)
    if kind == 2:  # the top and one float32 ulp below it, alternating: near-cancelling residuals
        return np.where(np.arange(n_items) % 2 == 0, hi, float(np.nextafter(np.float32(hi), np.float32(lo))))
    return rng.uniform(lo, hi, n_items)


def _altmin_attack(solve_spy, gradient_spy, method, rating_range, restarts, seed):
    rng = np.random.default_rng(seed)
    n_users, n_items, k = 24, 10, 4
    user, item, rating = _altmin_data(rng, rating_range, n_users, n_items, k)
    ssp = "dpals" in method
    cfg = AltMinConfig(method=method, epsilon=2.0, steps=1, dim=2, budget=k, rating_range=rating_range,
                       count_release=False if Method.parse(method).optional_counts else None,
                       sgd_inner_steps=1, show_progress=False,
                       label_norm=0.5 * (rating_range[1] - rating_range[0]) if ssp else None)
    worst = {}
    for r in range(restarts):
        t = n_items if r < 2 else int(rng.integers(1, n_items + 1))
        items = rng.choice(n_items, t, replace=False)
        crafted = np.clip(_crafted_ratings(rng, r, n_items, rating_range)[:t], *rating_range)
        data = Interactions(np.r_[user, np.full(t, n_users - 1)], np.r_[item, items], np.r_[rating, crafted],
                            n_users, n_items)
        without = Interactions(user, item, rating, n_users, n_items)
        solve_spy.clear()
        gradient_spy.clear()
        model = fit(data, cfg, seed=r)
        fit(without, cfg, seed=r)
        rel = {x.name: x for x in model.report.releases}
        if ssp:
            (a1, b1), (a0, b0) = (_stacks(*solve_spy[i], n_items) for i in (0, len(solve_spy) // 2))
            sens_a = next(v.sensitivity for name, v in rel.items() if name.endswith("A (Gram)"))
            sens_b = next(v.sensitivity for name, v in rel.items() if name.endswith("b (rhs)"))
            # other users: k − 1 rows of weight 1, features ≤ Γx, labels ≤ Γy: the float32 sums' scale
            gx, gy = model.config.item_feature_bound, model.config.label_clip
            slack_a = 2 * n_users * U32 * n_users * (k - 1) * gx**2
            slack_b = 2 * n_users * U32 * n_users * (k - 1) * gx * gy
            for name, diff, sens, slack in (("A", np.linalg.norm(a1 - a0), sens_a, slack_a),
                                            ("b", np.linalg.norm(b1 - b0), sens_b, slack_b)):
                worst[name] = max(worst.get(name, 0.0), diff / sens)
                assert diff <= sens * (1 + REL) + slack, (method, rating_range, r, name, diff / sens)
        else:
            g1, g0 = gradient_spy[0], gradient_spy[len(gradient_spy) // 2]
            sens = next(v.sensitivity for name, v in rel.items() if name.endswith("step"))
            slack = 2 * n_users * U32 * n_users * sens
            diff = np.linalg.norm(g1 - g0)
            worst["step"] = max(worst.get("step", 0.0), diff / sens)
            assert diff <= sens * (1 + REL) + slack, (method, rating_range, r, diff / sens)
    for name, ratio in worst.items():
        _record(f"altmin {method} {name} {rating_range}", ratio)


@pytest.mark.parametrize("method, rating_range", [("ada-dpals", (-1e6, 1e6)), ("ada-dpsgd", (0.5, 5.0))])
def test_altmin_item_update_adversarial(solve_spy, gradient_spy, method, rating_range):
    _altmin_attack(solve_spy, gradient_spy, method, rating_range, 3, 0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ada-dpals", "dpals-uniform", "ada-dpsgd", "dpsgd-uniform"])
@pytest.mark.parametrize("rating_range", [(0.5, 5.0), (-1e6, 1e6), (0.0, 1e-6)])
def test_altmin_item_update_adversarial_broad(solve_spy, gradient_spy, method, rating_range):
    _altmin_attack(solve_spy, gradient_spy, method, rating_range, 8, 1)


def test_altmin_fit_refuses_invalid_ratings():
    rng = np.random.default_rng(0)
    user, item, rating = _altmin_data(rng, (0.5, 5.0))
    cfg = AltMinConfig(method="ada-dpals", epsilon=2.0, steps=1, dim=2, budget=4, show_progress=False)
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="finite"):
            fit(Interactions(user, item, np.r_[rating[:-1], bad], 24, 10), cfg, seed=0)
    with pytest.raises(ValueError, match="rating_range"):
        fit(Interactions(user, item, np.r_[rating[:-1], 1e6], 24, 10), cfg, seed=0)
    with pytest.raises(ValueError, match="duplicate"):
        fit(Interactions(np.r_[user, user[:1]], np.r_[item, item[:1]], np.r_[rating, rating[:1]], 24, 10), cfg, seed=0)
    with pytest.raises(ValueError):
        fit(Interactions(np.r_[user, 24], np.r_[item, 0], np.r_[rating, 1.0], 24, 10), cfg, seed=0)  # padding id


def teardown_module(module):
    for name, ratio in sorted(WORST.items()):
        print(f"worst ratio {name}: {ratio:.9f}")
