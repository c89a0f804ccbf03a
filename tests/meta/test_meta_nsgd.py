"""Tests for jdp.meta: privacy mechanics, accounting, base learners, input validation, small orderings."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event as dpe

from jdp import accounting
from jdp import meta as M
from jdp.meta import engine, privacy
from jdp.meta.ftmrl import tree_depth

KEY = jax.random.PRNGKey(0)
RIDGE = M.RidgeLearner(lam=0.8)
DIM = 6


def _tasks(n_tasks=40, n_points=8, key=KEY, mean=3.0):
    tasks, _ = M.single_cluster_regression(key, n_tasks, n_points=n_points, dim=DIM, mean=mean)
    return tasks


# One shared shape (200 tasks x 10 points) so the jit-compiled engines (and generators) are reused;
# smaller task sets are slices of it.
K_TRAIN, BATCH = 200, 10
_KTR, _KTE = jax.random.split(jax.random.PRNGKey(11))
TRAIN = _tasks(K_TRAIN, 10, _KTR, mean=4.0)
FT, TS = _tasks(200, 30, _KTE, mean=4.0).split_points(10)


def _first(k, offset=0):
    return TRAIN.take(jnp.arange(offset, offset + k))


# ---------------------------------------------------------------------------------------------------
# Tree aggregation.
def test_tree_prefix_noise_variance_is_popcount_times_sigma2():
    sigma, depth, n_keys, dim = 1.7, tree_depth(31), 3000, 8
    keys = jax.random.split(jax.random.PRNGKey(3), n_keys)
    ts = jnp.arange(1, 32)
    noise = jax.vmap(lambda k: jax.vmap(lambda t: M.tree_prefix_noise(k, t, dim, sigma, depth))(ts))(keys)
    var = np.asarray(jnp.var(noise, axis=(0, 2)))  # [31]
    expected = np.array([bin(t).count("1") for t in range(1, 32)]) * sigma ** 2
    np.testing.assert_allclose(var, expected, rtol=0.06)
    # prefixes share dyadic nodes: noise(3) = node(0,3) + node(1,1), noise(2) = node(1,1)
    cov = float(jnp.mean(noise[:, 2] * noise[:, 1]))
    assert abs(cov - sigma ** 2) < 0.08 * sigma ** 2
    # noise(4) = node(2,1) shares nothing with noise(3)
    assert abs(float(jnp.mean(noise[:, 3] * noise[:, 2]))) < 0.08 * sigma ** 2


def test_tree_event_accounted_under_replace_special_matches_gaussian_cross_check():
    z, steps, delta = 3.0, 100, 1e-5
    eps = accounting.compute_epsilon(privacy.tree_event(z, steps), delta, relation=accounting.REPLACE_SPECIAL)
    # cross-check: RDP α·ceil(log2(T+1))/(2z²) = Gaussian with z/sqrt(depth) (hand formula, test only)
    ref = accounting.compute_epsilon(dpe.GaussianDpEvent(z / math.sqrt(tree_depth(steps))), delta)
    assert eps == pytest.approx(ref, rel=1e-6)
    with pytest.raises(ValueError, match="does not support"):
        accounting.compute_epsilon(privacy.tree_event(z, steps), delta, relation=accounting.ADD_OR_REMOVE_ONE)


# ---------------------------------------------------------------------------------------------------
# Clustering sensitivity.
@pytest.mark.parametrize("q", [1, 2, 3])
def test_clustering_update_sensitivity_is_clip_for_any_q(q):
    clip = 0.5
    tasks = _first(6)  # ‖w‖ ≈ 10 is far from h: every meta-gradient is clipped, so the bound is attained
    spec = engine.FlatSpec.of(jnp.zeros(DIM))
    h = jax.random.normal(jax.random.PRNGKey(q), (q, DIM))
    sens = np.asarray(M.update_sensitivity(RIDGE, spec, h, tasks, KEY, clip))
    np.testing.assert_allclose(sens, clip, rtol=1e-4)
    # replace-one: any task swapped for any other moves the update by at most 2C
    other = _first(6, offset=6)
    from jdp.meta.clustering import routed_update
    mixed = M.TaskSet(jax.tree.map(lambda a, b: a.at[0].set(b[0]), tasks.data, other.data), tasks.mask)
    diff = routed_update(RIDGE, spec, h, tasks, KEY, clip) - routed_update(RIDGE, spec, h, mixed, KEY, clip)
    assert float(jnp.linalg.norm(diff)) <= 2 * clip + 1e-5
    # the routed update puts each task's clipped gradient in exactly one model
    u = routed_update(RIDGE, spec, h, tasks, KEY, clip)
    assert float(jnp.sum(jnp.linalg.norm(u, axis=1))) <= tasks.n_tasks * clip + 1e-4


# ---------------------------------------------------------------------------------------------------
# Accounting matches the sampling actually used.
def _unwrap(report):
    (rel,) = report.releases
    ev = rel.event
    assert isinstance(ev, dpe.SelfComposedDpEvent)
    return rel, ev


def test_events_match_sampling_and_spend_the_budget():
    tasks = TRAIN
    common = dict(epsilon=2.0, delta=1e-5, steps=5, batch_size=BATCH, meta_lr=0.5, l2_clip=1.0)
    r = M.meta_nsgd(KEY, tasks, RIDGE, jnp.zeros(DIM), sampling="poisson", **common)
    rel, ev = _unwrap(r.report)
    assert ev.count == 5 and isinstance(ev.event, dpe.PoissonSampledDpEvent)
    assert ev.event.sampling_probability == pytest.approx(BATCH / K_TRAIN)
    assert r.report.relation is accounting.ADD_OR_REMOVE_ONE and r.report.unit == "task"
    assert rel.sensitivity == 1.0 and rel.noise_scale == pytest.approx(r.noise_multiplier)
    assert r.report.epsilon() == pytest.approx(2.0, rel=1e-3)

    f = M.meta_nsgd(KEY, tasks, RIDGE, jnp.zeros(DIM), sampling="fixed", **common)
    rel, ev = _unwrap(f.report)
    assert isinstance(ev.event, dpe.SampledWithoutReplacementDpEvent)
    assert (ev.event.source_dataset_size, ev.event.sample_size) == (K_TRAIN, BATCH)
    assert f.report.relation is accounting.REPLACE_ONE and f.report.releases[0].relation is accounting.REPLACE_ONE
    assert rel.sensitivity == 2.0  # replacing a task moves a sum of C-clipped vectors by up to 2C
    assert f.noise_std == pytest.approx(2.0 * f.noise_multiplier)
    assert f.report.epsilon() == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError, match="does not support"):  # wrong relation for this event
        accounting.compute_epsilon(ev, 1e-5, relation=accounting.ADD_OR_REMOVE_ONE)

    t = M.dp_ftmrl(KEY, tasks, RIDGE, jnp.zeros(DIM), epsilon=2.0, delta=1e-5, meta_lr=0.5, l2_clip=1.0, batch_size=5)
    (rel,) = t.report.releases
    assert isinstance(rel.event, dpe.SingleEpochTreeAggregationDpEvent) and rel.event.step_counts == K_TRAIN // 5
    assert t.report.relation is accounting.REPLACE_SPECIAL
    assert t.report.epsilon() == pytest.approx(2.0, rel=1e-3)
    d = t.report.to_dict()
    assert d["unit"] == "task" and d["neighbouring_relation"] == "replace_special"


def test_calibrated_run_compiles_its_training_program_once(caplog):
    """run_private compiles the training program beside the calibration (it does not read σ) and then calls it:
    one XLA compilation, not a second one for the call, and the same result as a run given the calibrated σ."""
    import logging
    tasks = _first(37)  # a task count of its own: a fresh program
    common = dict(delta=1e-5, steps=4, batch_size=BATCH, meta_lr=0.5, l2_clip=1.0)
    jax.config.update("jax_log_compiles", True)  # process-wide: the compilation runs in a worker thread
    try:
        with caplog.at_level(logging.WARNING):
            r = M.meta_nsgd(KEY, tasks, RIDGE, jnp.zeros(DIM), epsilon=2.0, **common)
            same = M.meta_nsgd(KEY, tasks, RIDGE, jnp.zeros(DIM), epsilon=None, noise_multiplier=r.noise_multiplier,
                               **common)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [m for m in caplog.messages if m.startswith("Finished XLA compilation of jit(train)")]
    assert len(compiled) == 1, compiled
    np.testing.assert_allclose(np.asarray(same.flat), np.asarray(r.flat), rtol=1e-6)


def test_poisson_calibration_regression_value():
    # the authors' setting N = T = 100, batch 10, ε = 3, δ = 1e-5 (TF-Privacy digits 1.798 with its orders)
    z = privacy.calibrate_meta_sgd(3.0, 1e-5, 100, 10, 100, "poisson")
    assert z == pytest.approx(1.796, abs=0.01)


def test_theory_calibration_formula_and_report():
    sigma, m = M.theory_noise(1.0, 1e-5, 400, 100, 2.0)
    assert sigma == pytest.approx(math.sqrt(8 * 100 * 4 * math.log(1e5) / (400 ** 2)))
    assert m == round(400 * math.sqrt(1 / 400))
    # ε/(4T) = 1/400 gives the theory batch m = K/20 = 10 (= BATCH, so the compiled engine is reused)
    r = M.meta_nsgd(KEY, TRAIN, RIDGE, jnp.zeros(DIM), epsilon=0.05, delta=1e-5, steps=5, batch_size=3,
                    meta_lr=0.5, l2_clip=2.0, calibration="theory")
    s, m = M.theory_noise(0.05, 1e-5, K_TRAIN, 5, 2.0)
    assert r.batch_size == m == BATCH and r.noise_std == pytest.approx(s * m)
    assert r.report.epsilon() <= 0.05  # the closed form is conservative for this mechanism


def test_engine_noise_scale_and_poisson_chunks_unbiased():
    k, n, m, eta, std = 12, 10, 3, 0.5, 2.0
    spec = engine.FlatSpec.of(jnp.zeros(DIM))
    h0 = jnp.zeros((1, DIM))
    # one compiled runner (Poisson, chunks of 1 task, so realised batches above m take several chunks)
    run = jax.jit(jax.vmap(lambda kk, data, mask, steps, noise, lr, clip: engine.train(
        kk, data, mask, h0, learner=RIDGE, spec=spec, batch_size=m, sampling="poisson", steps=steps, n_active=k,
        meta_lr=lr, l2_clip=clip, noise_std=noise, radius=jnp.float32(jnp.inf), chunk=1)[0],
        in_axes=(0, None, None, None, None, None, None)))
    keys = jax.random.split(KEY, 3000)
    # zero tasks: w_h = h, meta-gradients vanish, so h_T - h_0 is pure noise with var T (η std/m)^2
    zero = M.TaskSet((jnp.zeros((k, n, DIM)), jnp.zeros((k, n))), jnp.ones((k, n)))
    out = run(keys, zero.data, zero.mask, 4, jnp.float32(std), jnp.float32(eta), jnp.float32(1.0))
    assert float(jnp.var(out)) == pytest.approx(4 * (eta * std / m) ** 2, rel=0.06)
    # no noise: the mean one-step update equals the mean meta-gradient over all tasks (no task dropped)
    tasks = _first(k)
    upd = -jnp.mean(run(keys, tasks.data, tasks.mask, 1, jnp.float32(0.0), jnp.float32(1.0),
                        jnp.float32(jnp.inf)), axis=0)[0]
    grads = jax.vmap(lambda d, mk: M.meta_gradient(RIDGE, h0[0], d, mk, KEY))(tasks.data, tasks.mask)
    np.testing.assert_allclose(upd, jnp.mean(grads, axis=0), atol=0.06 * float(jnp.abs(grads).mean()) + 0.02)


# ---------------------------------------------------------------------------------------------------
# Base learners.
def test_ridge_closed_form_equals_gd_and_envelope_gradient():
    tasks = _first(1)
    data = jax.tree.map(lambda a: a[0], tasks.data)
    mask = tasks.mask[0]
    h = jnp.linspace(-1, 1, DIM)
    w_ridge = RIDGE.fit(h, data, mask, KEY)
    gd = M.SGDLearner(M.squared_loss, lam=0.8, steps=3000, lr=0.3)
    np.testing.assert_allclose(gd.fit(h, data, mask, KEY), w_ridge, atol=1e-3)
    # ∇ of the Moreau envelope L(h) = min_w R(w) + λ/2‖w−h‖² is λ(h − w_h)
    env = lambda hh: RIDGE.objective(RIDGE.fit(hh, data, mask, KEY), hh, data, mask)
    with jax.default_matmul_precision("highest"):  # an identity of the maths: GPUs' TF32 missed atol by 4%
        np.testing.assert_allclose(jax.grad(env)(h), M.meta_gradient(RIDGE, h, data, mask, KEY), atol=1e-4)
    # minibatch SGD uses only real (mask = 1) examples: padding with garbage changes nothing in expectation
    sgd = M.SGDLearner(M.squared_loss, lam=0.8, steps=5, lr=0.1, batch_size=3)
    m2 = mask.at[-2:].set(0.0)
    d2 = (data[0].at[-2:].set(100.0), data[1].at[-2:].set(-100.0))
    w = sgd.fit(h, d2, m2, KEY)
    assert bool(jnp.all(jnp.abs(w) < 20))


def test_generic_pytree_loss():
    def loss(p, ex):
        x, y = ex
        return (jnp.tanh(x @ p["w"]) @ p["v"] + p["b"] - y) ** 2

    template = {"w": jnp.zeros((DIM, 3)), "v": jnp.zeros(3), "b": jnp.zeros(())}
    learner = M.SGDLearner(loss, lam=1.0, steps=3, lr=0.1, batch_size=4)
    r = M.meta_nsgd(KEY, TRAIN, learner, template, noise_multiplier=1.0, epsilon=None, delta=1e-5, steps=3,
                    batch_size=BATCH, meta_lr=0.5, l2_clip=1.0)
    p = r.params()
    assert jax.tree.structure(p) == jax.tree.structure(template) and p["w"].shape == (DIM, 3)
    assert bool(jnp.all(jnp.isfinite(r.flat)))


# ---------------------------------------------------------------------------------------------------
# Input validation.
def test_bad_inputs_raise_clear_errors():
    tasks = _first(10)
    base = dict(epsilon=1.0, delta=1e-5, steps=3, batch_size=2, meta_lr=0.5, l2_clip=1.0)
    h0 = jnp.zeros(DIM)
    for field, bad in [("epsilon", 0.0), ("epsilon", float("nan")), ("delta", 1.5), ("l2_clip", -1.0),
                       ("batch_size", 11), ("steps", 0), ("meta_lr", 0.0), ("sampling", "uniform"),
                       ("output", "best"), ("calibration", "guess")]:
        with pytest.raises(ValueError, match=field):
            M.meta_nsgd(KEY, tasks, RIDGE, h0, **{**base, field: bad})
    with pytest.raises(ValueError, match="exactly one"):
        M.meta_nsgd(KEY, tasks, RIDGE, h0, **base, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="q"):
        M.private_clustering_meta(KEY, tasks, RIDGE, 0, template=h0, **base)
    with pytest.raises(ValueError, match="h0"):
        M.meta_nsgd(KEY, tasks, RIDGE, jnp.full(DIM, jnp.nan), **base)
    with pytest.raises(ValueError, match="NaN"):
        M.make_taskset((np.full((2, 3, DIM), np.nan), np.zeros((2, 3))))
    for bad_h0 in (jnp.zeros(DIM - 1), jnp.zeros((DIM, 2))):  # caught before any calibration or training
        with pytest.raises(ValueError, match="does not fit the learner|meta-gradient has shape"):
            M.meta_nsgd(KEY, tasks, RIDGE, bad_h0, epsilon=1.0, delta=1e-5, steps=2, batch_size=BATCH, meta_lr=0.5,
                        l2_clip=1.0)
        with pytest.raises(ValueError, match="does not fit the learner|meta-gradient has shape"):
            M.dp_ftmrl(KEY, tasks, RIDGE, bad_h0, epsilon=1.0, delta=1e-5, meta_lr=0.5, l2_clip=1.0)
    with pytest.raises(ValueError, match="mask"):
        M.make_taskset((np.zeros((2, 3, DIM)), np.zeros((2, 3))), mask=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="lam"):
        M.RidgeLearner(lam=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        M.dp_ftmrl(KEY, tasks, RIDGE, h0, epsilon=-1.0, delta=1e-5, meta_lr=0.5, l2_clip=1.0)
    with pytest.raises(ValueError, match="cannot reach"):
        accounting.calibrate(lambda s: M.tree_event(s, 10), 1e-4, 1e-5, relation=accounting.REPLACE_SPECIAL,
                             bracket=(0.1, 1.0))


# ---------------------------------------------------------------------------------------------------
# Quality orderings at small size (the benchmark checks the paper-size ones).
def test_small_quality_orderings():
    train, ft, ts, key_tr, key_te = TRAIN, FT, TS, _KTR, _KTE
    common = dict(steps=150, batch_size=BATCH, meta_lr=0.5)
    local = M.local_training_risk(KEY, RIDGE, jnp.zeros(DIM), ft, ts)
    priv = M.transfer_risk(KEY, RIDGE, M.meta_nsgd(KEY, train, RIDGE, jnp.zeros(DIM), epsilon=1.0, delta=1e-5,
                                                    l2_clip=4.0, output="last", **common), ft, ts)
    nonp = M.transfer_risk(KEY, RIDGE, M.meta_sgd_nonprivate(KEY, train, RIDGE, h0=jnp.zeros(DIM), sampling="poisson",
                                                             **common), ft, ts)
    ftrl = M.transfer_risk(KEY, RIDGE, M.dp_ftmrl(KEY, train, RIDGE, jnp.zeros(DIM), epsilon=1.0, delta=1e-5,
                                                  meta_lr=0.1, l2_clip=4.0, batch_size=5, output="last"), ft, ts)
    assert nonp < priv < local
    assert ftrl < local
    # multi-cluster: three meta-models beat one (non-private and private)
    centres = jnp.array([[3.0] * 2 + [0.0] * 4, [0.0] * 2 + [-4.0] * 2 + [0.0] * 2, [0.0] * 4 + [5.0] * 2])
    mtrain, _, _ = M.multi_cluster_regression(key_tr, 200, n_points=10, dim=DIM, centres=centres)
    mtest, _, _ = M.multi_cluster_regression(key_te, 200, n_points=30, dim=DIM, centres=centres)
    mft, mts = mtest.split_points(10)
    risks = {q: M.transfer_risk(KEY, RIDGE, M.private_clustering_meta(
        KEY, mtrain, RIDGE, q, epsilon=10.0, delta=1e-5, l2_clip=2.0, template=jnp.zeros(DIM), **common), mft, mts)
        for q in (1, 3)}
    assert risks[3] < risks[1]
