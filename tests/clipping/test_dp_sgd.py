"""DP-SGD helper: accounting matches dp_accounting, Poisson sampling, noise scale, a short run."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

import jdp.clipping as jc


def _rdp_eps(sigma, q, steps, delta):
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def test_accounting_matches_dp_accounting():
    dp = jc.dp_sgd(lambda p, b: b["x"], optax.sgd(0.1), num_examples=10_000, batch_size=100, l2_clip=1.0,
                   delta=1e-5, epochs=2, epsilon=3.0)
    assert dp.steps == 200 and dp.sampling_rate == pytest.approx(0.01)
    eps = _rdp_eps(dp.noise_multiplier, 0.01, 200, 1e-5)
    assert eps <= 3.0 + 1e-6 and eps > 2.95           # calibrated, not over-noised
    rep = dp.report()
    assert rep.epsilon() == pytest.approx(eps, rel=1e-9)
    assert dp.epsilon() == pytest.approx(eps, rel=1e-9)
    d = rep.to_dict()
    assert d["releases"][0]["count"] == 200 and d["unit"] == "example"
    assert d["releases"][0]["noise_scale"] == pytest.approx(dp.noise_multiplier)
    # fewer steps spend less
    assert rep.epsilon() > dp.report(50).epsilon()
    # event is the one actually used: Poisson-sampled Gaussian
    ev = dp.event()
    assert isinstance(ev, dpe.SelfComposedDpEvent) and isinstance(ev.event, dpe.PoissonSampledDpEvent)


def test_calibration_after_earlier_releases_meets_the_total_budget():
    # releases before training (e.g. a histogram) composed with the steps: the one calibration of DP-SGD's sigma
    from jdp.accounting import PrivacyReport, gaussian_event
    from jdp.clipping.dp_sgd import DP_SGD_RELEASE, dp_sgd_release
    before = [gaussian_event(8.0)]
    alone = jc.calibrate_noise_multiplier(2.0, 1e-5, 0.01, 300)
    after = jc.calibrate_noise_multiplier(2.0, 1e-5, 0.01, 300, before=before)
    assert after > alone
    rep = PrivacyReport(1e-5)
    rep.add("histogram", before[0])
    rep.add_release(dp_sgd_release(after, 0.01, 0.5, 300))
    assert rep.epsilon() <= 2.0 + 1e-9 and rep.epsilon() > 1.98
    line = rep.releases[-1]
    assert (line.name, line.count, line.sensitivity, line.noise_scale) == (DP_SGD_RELEASE, 300, 0.5, after * 0.5)
    with pytest.raises(ValueError, match="steps"):
        dp_sgd_release(1.0, 0.01, 1.0, 0)


def test_invalid_arguments():
    kw = dict(num_examples=100, batch_size=10, l2_clip=1.0, delta=1e-5, steps=10, noise_multiplier=1.0)
    for bad, name in [(dict(l2_clip=0.0), "l2_clip"), (dict(delta=1.0), "delta"), (dict(batch_size=200), "batch_size"),
                      (dict(steps=0), "steps"), (dict(method="x"), "method")]:
        with pytest.raises(ValueError, match=name):
            jc.dp_sgd(lambda p, b: b, optax.sgd(0.1), **{**kw, **bad})
    with pytest.raises(ValueError, match="epsilon"):
        jc.dp_sgd(lambda p, b: b, optax.sgd(0.1), **{**kw, "noise_multiplier": None, "epsilon": -1.0})
    with pytest.raises(ValueError, match="exactly one"):
        jc.dp_sgd(lambda p, b: b, optax.sgd(0.1), **{**kw, "epsilon": 1.0})


def test_poisson_sample_and_noise_scale():
    idx, mask, count = jc.poisson_sample(jax.random.PRNGKey(0), 1000, 0.1, 160)
    assert idx.shape == (160,) and mask.shape == (160,)
    n = int(count)
    assert int(mask.sum()) == n and abs(n - 100) < 40
    assert len(set(np.asarray(idx[:n]).tolist())) == n and np.all(np.asarray(idx[n:]) == 0)
    rates = [float(jc.poisson_sample(jax.random.PRNGKey(s), 1000, 0.1, 200)[2]) for s in range(20)]
    assert abs(np.mean(rates) - 100) < 10                     # 20 draws: std of mean ~2.1
    # noise: std = sigma * sensitivity / expected batch size
    tx = jc.dp_aggregate(2.0, 0.5, 10.0, jax.random.PRNGKey(1))
    zeros = {"w": jnp.zeros((200, 100))}
    upd, state = tx.update(zeros, tx.init(zeros))
    assert float(jnp.std(upd["w"])) == pytest.approx(0.1, rel=0.03)
    upd2, _ = tx.update(zeros, state)
    assert not np.allclose(upd["w"], upd2["w"])               # fresh noise each step


def test_fit_short_run_learns():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))

    model = Net()
    k = jax.random.PRNGKey(0)
    x = jax.random.normal(k, (512, 4))
    y = (x[:, 0] + x[:, 1] > 0).astype(jnp.int32)
    params = model.init(k, x[:1])["params"]

    def loss_fn(p, b):
        lp = jax.nn.log_softmax(model.apply({"params": p}, b["x"]))
        return -jnp.take_along_axis(lp, b["y"][:, None], 1)[:, 0]

    dp = jc.dp_sgd(loss_fn, optax.adam(0.05), num_examples=512, batch_size=64, l2_clip=1.0, delta=1e-5,
                   steps=40, epsilon=8.0)
    new, report, hist = dp.fit(params, {"x": x, "y": y}, jax.random.PRNGKey(1), progress=False)
    acc = float(jnp.mean(jnp.argmax(model.apply({"params": new}, x), -1) == y))
    assert acc > 0.8
    assert report.epsilon() <= 8.0 + 1e-6
    assert len(hist) == 40 and all(np.isfinite(h["loss"]) for h in hist)
    with pytest.raises(ValueError, match="steps"):
        dp.fit(params, {"x": x, "y": y}, jax.random.PRNGKey(1), steps=41, progress=False)


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_aux_is_an_input_of_the_step_not_a_baked_constant(method):
    # a shared, non-differentiated value (e.g. a released statistic) passed as `aux`: the same clipped sum as
    # closing over it, and a new value reuses the compiled step (no retrace, no recompile)
    model = nn.Dense(3)
    x = jax.random.normal(jax.random.key(0), (6, 4))
    params = model.init(jax.random.key(1), x[:1])
    batch = {"x": x, "y": jnp.arange(6) % 3}

    def loss(p, b, aux):
        logits = model.apply(p, b["x"]) * aux["scale"] + aux["shift"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])

    kw = dict(num_examples=60, batch_size=6, l2_clip=0.5, delta=1e-5, steps=3, noise_multiplier=1.0, method=method)
    dp = jc.dp_sgd(loss, optax.sgd(0.1), **kw)
    acc = dp.accumulate
    zero = jax.tree.map(jnp.zeros_like, params)
    mask = jnp.ones(6, bool)
    for scale in (0.5, 2.0, 3.0):
        aux = {"scale": jnp.float32(scale), "shift": jnp.linspace(0.0, 1.0, 3)}
        got, sums = acc(params, zero, batch, mask, aux)
        closed = jc.dp_sgd(lambda p, b: loss(p, b, aux), optax.sgd(0.1), **kw)
        want, _ = closed.accumulate(params, zero, batch, mask)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert float(sums["count"]) == 6
    assert acc._cache_size() == 1


@pytest.mark.slow
def test_noise_key_is_left_out_of_a_saved_state_and_rebuilt_from_the_run_key():
    """`without_noise_key` zeroes the key that would predict the later steps' noise; `with_noise_key` rebuilds
    it from the run's key and the update count, so a resumed run draws the same noise as an uninterrupted one."""
    from jdp.clipping.dp_sgd import DPAggregateState, dp_aggregate, with_noise_key, without_noise_key
    key = jax.random.key_data(jax.random.key(7))
    tx = optax.chain(dp_aggregate(1.0, 1.0, 4.0, key), optax.sgd(0.1))
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": jnp.ones(3)}, state, params)
    bare = without_noise_key(state)
    assert isinstance(bare[0], DPAggregateState) and int(bare[0].count) == 3 and not np.any(np.asarray(bare[0].key))
    np.testing.assert_array_equal(np.asarray(with_noise_key(bare, key)[0].key), np.asarray(state[0].key))
    assert without_noise_key(params) == params  # no dp_aggregate state: unchanged
