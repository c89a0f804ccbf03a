import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.accounting import PrivacyReport
from jdp.multitask import gram, ssp, weights as W
from jdp.multitask.counts import private_counts, private_mean
from jdp.multitask.noisy_gd import NoisyGDConfig, task_weighted_noisy_gd


def _random_instance(seed, m=12, n=60, d=3, density=0.3):
    rng = np.random.default_rng(seed)
    mask = rng.random((n, m)) < rng.uniform(0.05, density * 2, m)[None, :]
    user, task = np.nonzero(mask)
    x = rng.normal(size=(user.size, d)).astype(np.float32) * 2
    y = rng.normal(size=user.size).astype(np.float32) * 3
    return rng, task, user, x, y, m, n


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["clip", "normalize"])
def test_adaptive_weights_respect_user_budget(seed, mode):
    rng, task, user, _, _, m, n = _random_instance(seed)
    counts = jnp.asarray(rng.uniform(-5, 80, m))  # noisy counts, some below 1
    for mu in (0.0, 0.25, 0.5, 1.0):
        w = np.asarray(W.adaptive_weights(counts, jnp.asarray(user), jnp.asarray(task), n, 4.0, mu, mode))
        per_user = np.bincount(user, weights=w.astype(np.float64) ** 2, minlength=n)
        assert per_user.max() <= 4.0  # exact (float64) sums: no slack
        if mode == "normalize":  # reference normalisation: β (less a 1e-3 float32 margin) for every user
            assert np.allclose(per_user[np.bincount(user, minlength=n) > 0], 4.0, rtol=2e-3)


@pytest.mark.parametrize("mode", ["clip", "normalize"])
def test_heavy_users_stay_within_budget_despite_float32_sums(mode):
    """Users with thousands of tasks: float32 per-user sums are inexact; the exact sum must still be ≤ β."""
    rng = np.random.default_rng(0)
    m, n = 20_000, 40
    sizes = rng.integers(1, m, n)
    user = np.repeat(np.arange(n), sizes)
    task = np.concatenate([rng.choice(m, s, replace=False) for s in sizes])
    counts = jnp.asarray(rng.uniform(1, 5000, m).astype(np.float32))
    for mu in (0.0, 0.25, 0.5):
        w = np.asarray(W.adaptive_weights(counts, jnp.asarray(user), jnp.asarray(task), n, 100.0, mu, mode))
        assert np.bincount(user, weights=w.astype(np.float64) ** 2, minlength=n).max() <= 100.0


def test_task_weights_normalisation_and_tail_bias():
    counts = jnp.array([1000.0, 100.0, 10.0, 1.0])
    om = np.asarray(W.task_weights(counts, 0.5, n_users=50, beta=2.0))
    assert np.sum(np.asarray(counts) * om**2) == pytest.approx(100.0, rel=1e-5)
    assert np.all(np.diff(om) > 0)  # rarer tasks get larger weights
    assert np.allclose(np.asarray(W.task_weights(counts, 0.0, 50, 2.0)), om[0] * 0 + om.mean() * 0 + np.sqrt(100 / 1111))


def test_sampling_weights_keep_k_per_user():
    rng, task, user, _, _, m, n = _random_instance(1, density=0.5)
    counts = jnp.asarray(rng.uniform(1, 50, m))
    for w in (W.uniform_sampling_weights(jax.random.key(0), jnp.asarray(user), 3),
              W.tail_sampling_weights(jax.random.key(0), jnp.asarray(user), jnp.asarray(task), counts, 3)):
        kept = np.bincount(user, weights=np.asarray(w), minlength=n)
        assert np.all(kept == np.minimum(np.bincount(user, minlength=n), 3))
    w = np.asarray(W.tail_sampling_weights(jax.random.key(0), jnp.asarray(user), jnp.asarray(task), counts, 3))
    c = np.asarray(counts)[task]
    for j in range(n):  # kept tasks are the user's smallest counts
        mine = user == j
        if mine.sum() > 3:
            assert c[mine][w[mine] > 0].max() <= np.sort(c[mine])[2] + 1e-6


@pytest.mark.parametrize("seed", range(3))
def test_ssp_statistics_sensitivity_on_user_removal(seed):
    """Removing one user moves the stacked A by ≤ √β·Γx² and b by ≤ √β·Γx·Γy (clipped inputs)."""
    rng, task, user, x, y, m, n = _random_instance(seed)
    beta, gx, gy = 3.0, 1.5, 2.0
    counts = jnp.asarray(np.bincount(task, minlength=m).astype(np.float32))
    w = np.asarray(W.adaptive_weights(counts, jnp.asarray(user), jnp.asarray(task), n, beta, 0.5))
    feats = np.asarray(jax.vmap(lambda v: v * jnp.minimum(1.0, gx / jnp.linalg.norm(v)))(jnp.asarray(x)))
    yc = np.clip(y, -gy, gy)

    plan = gram.build_plan(task, np.arange(user.size), w, m)  # one layout; removal zeroes the user's weights
    _, si = gram.device_arrays(plan)
    labels = plan.slot_values(yc)

    def stats(keep):
        sw = [np.sqrt(v) for v in plan.slot_values(w * keep)]
        classes = tuple((jnp.asarray(c.src), jnp.asarray(s), jnp.asarray(l)) for c, s, l in zip(plan.classes, sw, labels))
        a, b = gram.gram_unsharded(jnp.asarray(feats), classes, si)
        return np.asarray(a)[plan.flat_index], np.asarray(b)[plan.flat_index]

    a_full, b_full = stats(np.ones(user.size, bool))
    for j in rng.choice(np.unique(user), 5, replace=False):
        a_j, b_j = stats(user != j)
        assert np.linalg.norm(a_full - a_j) <= np.sqrt(beta) * gx**2 * (1 + 1e-4)
        assert np.linalg.norm(b_full - b_j) <= np.sqrt(beta) * gx * gy * (1 + 1e-4)


def test_bucketed_gram_equals_segment_sum_reference():
    rng = np.random.default_rng(3)
    m, rows, nnz, d = 40, 500, 3000, 6
    task = (rng.zipf(1.4, nnz) - 1) % m
    src = rng.integers(0, rows, nnz)
    w, y = rng.random(nnz).astype(np.float32), rng.normal(size=nnz).astype(np.float32)
    feats = jnp.asarray(rng.normal(size=(rows, d)).astype(np.float32))
    ref_a, ref_b = gram.segment_sum_gram(feats, jnp.asarray(task), jnp.asarray(src), jnp.asarray(w), jnp.asarray(y), m, chunk=2048)
    for shards in (1, 3):
        plan = gram.build_plan(task, src, w, m, n_shards=shards)
        classes, si = gram.device_arrays(plan, plan.slot_values(y))
        a, b = gram.gram_unsharded(feats, classes, si)
        np.testing.assert_allclose(np.asarray(a)[plan.flat_index], ref_a, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.asarray(b)[plan.flat_index], ref_b, rtol=1e-4, atol=1e-3)


@pytest.mark.slow
@pytest.mark.multi_device
def test_ssp_sharded_equals_unsharded_and_recovers_tasks():
    assert len(jax.devices()) >= 4
    rng = np.random.default_rng(0)
    m, n, d = 24, 600, 4
    u = rng.normal(size=(n, d)); u /= np.maximum(1, np.linalg.norm(u, axis=1, keepdims=True))
    th = rng.normal(size=(m, d)); th /= np.maximum(1, np.linalg.norm(th, axis=1, keepdims=True))
    user, task = np.nonzero(rng.random((n, m)) < np.linspace(0.05, 0.9, m)[None, :])
    x, y = u[user], np.sum(u[user] * th[task], 1)
    w = np.asarray(W.clip_user_weights(jnp.ones(m), jnp.asarray(user), jnp.asarray(task), n, 10.0))
    kw = dict(beta=10.0, clip_x=1.0, clip_y=1.0, noise_multiplier=0.5, lam=1.0)
    rep = PrivacyReport(1e-5)
    t1 = ssp.task_weighted_ssp(jax.random.key(1), task, user, x, y, w, m, n, report=rep, n_shards=1, **kw)
    t4 = ssp.task_weighted_ssp(jax.random.key(1), task, user, x, y, w, m, n, n_shards=4, **kw)
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t4), rtol=1e-5, atol=1e-6)
    # popular tasks are recovered well; the report holds the two Gaussian releases (A and b)
    err = np.linalg.norm(np.asarray(t1) - th, axis=1)
    assert err[-10:].mean() < 0.35 and err[-10:].mean() < err[:10].mean()
    assert [r.name for r in rep.releases] == ["SSP A (Gram)", "SSP b (rhs)"]
    assert rep.releases[0].noise_scale == pytest.approx(0.5 * np.sqrt(10.0))


@pytest.mark.slow
@pytest.mark.multi_device
def test_prior_mean_of_the_last_coordinate_centres_the_ridge_on_the_same_release():
    """`prior_last`: exact statistics give (A + λI)θ = b + λ·t·e (e the constant last feature), on one device and
    sharded over four; noisy ones keep the released (Â, b̂) columns bit for bit (post-processing of one release),
    and t = 0 is the uncentred solve exactly."""
    rng = np.random.default_rng(5)
    m, rows, nnz, d, lam = 30, 400, 2500, 4, 2.0
    task = (rng.zipf(1.4, nnz) - 1) % m
    src = rng.integers(0, rows, nnz)
    w, y = rng.random(nnz).astype(np.float32), rng.normal(size=nnz).astype(np.float32)
    x = rng.normal(size=(rows, d)).astype(np.float32)
    x[:, -1] = 0.7  # the constant feature γ₀
    feats, t = jnp.asarray(x), rng.normal(size=m).astype(np.float32)
    ref_a, ref_b = gram.segment_sum_gram(feats, jnp.asarray(task), jnp.asarray(src), jnp.asarray(w), jnp.asarray(y), m,
                                         chunk=2048)
    ref_a, ref_b = np.asarray(ref_a, np.float64), np.asarray(ref_b, np.float64)
    e = np.eye(d)[-1]
    ref = np.linalg.solve(ref_a + lam * np.eye(d), (ref_b + lam * t[:, None] * e)[..., None])[..., 0]
    for shards, mesh in ((1, None), (4, ssp.task_mesh(4))):
        plan = gram.build_plan(task, src, w, m, n_shards=shards)
        classes, si = gram.device_arrays(plan, plan.slot_values(y))
        args = (feats, classes, gram.class_tasks(plan), si, jax.random.key(0))
        exact = np.asarray(ssp.solve_tasks(*args, 0.0, 0.0, lam, mesh=mesh, noisy=False, prior_last=t))[plan.flat_index]
        np.testing.assert_allclose(exact, ref, rtol=1e-4, atol=1e-5)
        noisy = {name: np.asarray(ssp.solve_tasks(*args, 0.5, 0.5, lam, mesh=mesh, bias_stats=True, prior_last=p)
                                  )[plan.flat_index] for name, p in (("none", None), ("zero", np.zeros(m)), ("t", t))}
        np.testing.assert_array_equal(noisy["zero"], noisy["none"])
        np.testing.assert_array_equal(noisy["t"][:, -2:], noisy["none"][:, -2:])  # the same released statistics
        assert np.abs(noisy["t"][:, -3] - noisy["none"][:, -3]).max() > 0.01  # the bias coordinate moved


def test_ssp_rejects_bad_inputs():
    rng, task, user, x, y, m, n = _random_instance(0)
    ok = dict(beta=1.0, clip_x=1.0, clip_y=1.0, noise_multiplier=1.0, lam=1.0)
    w = np.full(user.size, 10.0, np.float32)  # violates the per-user budget
    with pytest.raises(ValueError, match="budget"):
        ssp.task_weighted_ssp(jax.random.key(0), task, user, x, y, w, m, n, **ok)
    w = np.full(user.size, 0.01, np.float32)
    with pytest.raises(ValueError, match="clip_x"):
        ssp.task_weighted_ssp(jax.random.key(0), task, user, x, y, w, m, n, **{**ok, "clip_x": 0.0})
    with pytest.raises(ValueError, match="noise_multiplier"):
        ssp.task_weighted_ssp(jax.random.key(0), task, user, x, y, w, m, n, **{**ok, "noise_multiplier": -1.0})
    y_bad = y.copy(); y_bad[0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        ssp.task_weighted_ssp(jax.random.key(0), task, user, x, y_bad, w, m, n, **ok)
    with pytest.raises(ValueError, match="duplicate"):
        ssp.task_weighted_ssp(jax.random.key(0), np.r_[task, task[:1]], np.r_[user, user[:1]], np.r_[x, x[:1]],
                              np.r_[y, y[:1]], np.r_[w, w[:1]], m, n, **ok)


def test_private_counts_and_mean_record_releases_with_right_sensitivity():
    rng, task, user, _, y, m, n = _random_instance(2, density=0.5)
    rep = PrivacyReport(1e-5)
    pc = private_counts(jax.random.key(0), jnp.asarray(user), jnp.asarray(task), m, 4, 2.0, rep)
    assert pc.sensitivity == pytest.approx(2.0) and np.all(np.asarray(pc.counts) >= 1.0)
    mean = private_mean(jax.random.key(1), jnp.asarray(user), jnp.asarray(y), 3.0, 4, 1e-3, rep)
    ycl = np.clip(y, -3, 3)
    assert abs(mean - ycl.mean()) < 0.5  # tiny noise: close to the clipped mean of the ≤4-per-user sample
    assert [r.sensitivity for r in rep.releases] == [2.0, 12.0, 4.0]
    assert [r.noise_scale for r in rep.releases] == pytest.approx([4.0, 0.012, 0.004])


def test_noisy_gd_per_user_clipping_and_accounting():
    rng, task, user, x, y, m, n = _random_instance(4)
    cfg = NoisyGDConfig(l2_clip=0.5, noise_multiplier=1e-6, steps=200, learning_rate=0.5, sample_rate=1.0)
    rep = PrivacyReport(1e-5)
    theta = task_weighted_noisy_gd(jax.random.key(0), task, user, x, y, np.ones(user.size, np.float32), m, n, cfg,
                                   clip_x=1.0, clip_y=1.0, report=rep)
    assert np.all(np.isfinite(np.asarray(theta)))
    assert rep.releases[0].count == 200 and rep.releases[0].sensitivity == 0.5
    cfgp = NoisyGDConfig(l2_clip=0.5, noise_multiplier=1.0, steps=10, learning_rate=0.5, sample_rate=0.1)
    assert type(cfgp.step_event()).__name__ == "PoissonSampledDpEvent"
    with pytest.raises(ValueError, match="sample_rate"):
        NoisyGDConfig(l2_clip=0.5, noise_multiplier=1.0, steps=10, learning_rate=0.5, sample_rate=0.0)


def test_ssp_clips_features_and_labels_before_accumulating():
    rng, task, user, x, y, m, n = _random_instance(5)
    w = np.full(user.size, 0.1, np.float32)
    kw = dict(beta=10.0, noise_multiplier=1e-6, lam=1.0, n_shards=1)
    big = ssp.task_weighted_ssp(jax.random.key(0), task, user, 100 * x, 100 * y, w, m, n, clip_x=0.5, clip_y=0.7, **kw)
    xc = x * np.minimum(1.0, 0.5 / np.linalg.norm(100 * x, axis=1, keepdims=True)) * 100
    ref = ssp.task_weighted_ssp(jax.random.key(0), task, user, xc, np.clip(100 * y, -0.7, 0.7), w, m, n,
                                clip_x=0.5, clip_y=0.7, **kw)
    np.testing.assert_allclose(np.asarray(big), np.asarray(ref), rtol=1e-4, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(big)))


def test_inverse_count_is_the_posterior_mean_of_one_over_the_count():
    """E[1/n | n̂] under p(n) ∝ 1/n on [1, n_max] and Gaussian count noise, against numerical integration; exact
    counts (noise 0) and small relative noise give 1/max(n̂, 1); a count that came out high by a large noise is
    read as the prior reads it (mostly small counts), so the ridge built on it keeps shrinking."""
    from scipy import integrate

    from jdp.multitask.ssp import inverse_count

    def reference(n_hat, std, n_max):
        like = lambda n: np.exp(-0.5 * ((n_hat - n) / std) ** 2) / n  # noqa: E731
        num = integrate.quad(lambda n: like(n) / n, 1, n_max, limit=400, points=[max(1.0, min(n_max, n_hat))])[0]
        den = integrate.quad(like, 1, n_max, limit=400, points=[max(1.0, min(n_max, n_hat))])[0]
        return num / den

    n_hat = np.array([-50.0, 3.0, 40.0, 120.0, 900.0, 3000.0], np.float32)
    for std, n_max in ((20.0, 5000.0), (300.0, 5000.0)):
        got = np.asarray(inverse_count(jnp.asarray(n_hat), std, n_max))
        ref = np.array([1 / n if std <= 0.05 * n else reference(float(n), std, n_max) for n in n_hat])
        np.testing.assert_allclose(got, ref, rtol=0.03)
    exact = np.asarray(inverse_count(jnp.asarray(n_hat), 0.0, 5000.0))
    np.testing.assert_allclose(exact, 1 / np.maximum(n_hat, 1.0), rtol=1e-6)
    # a large noise: the count 900 is no evidence of a large count
    assert float(inverse_count(jnp.asarray([900.0]), 1000.0, 5000.0)[0]) > 10 / 900


def test_count_posterior_mean_of_a_power_against_numerical_integration():
    """The same posterior for E[n^(−μ) | n̂] (the adaptive weights' ω = n^(−μ), μ = 1/4), against quadrature."""
    from scipy import integrate

    from jdp.multitask.ssp import count_posterior_mean

    def reference(n_hat, std, n_max, mu):
        like = lambda n: np.exp(-0.5 * ((n_hat - n) / std) ** 2) / n  # noqa: E731
        pts = [max(1.0, min(n_max, n_hat))]
        num = integrate.quad(lambda n: like(n) * n ** -mu, 1, n_max, limit=400, points=pts)[0]
        return num / integrate.quad(like, 1, n_max, limit=400, points=pts)[0]

    n_hat = np.array([-50.0, 3.0, 40.0, 120.0, 900.0], np.float32)
    got = np.asarray(count_posterior_mean(jnp.asarray(n_hat), 65.0, 943.0, lambda n: n ** -0.25))
    ref = np.array([n ** -0.25 if 65.0 <= 0.05 * n else reference(float(n), 65.0, 943.0, 0.25) for n in n_hat])
    np.testing.assert_allclose(got, ref, rtol=0.01)
    exact = np.asarray(count_posterior_mean(jnp.asarray(n_hat), 0.0, 943.0, lambda n: n ** -0.25))
    np.testing.assert_allclose(exact, np.maximum(n_hat, 1.0) ** -0.25, rtol=1e-6)
