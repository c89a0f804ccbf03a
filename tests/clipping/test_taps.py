"""Conv and norm layers (linen), validators for what per-example evaluation cannot mean."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdp.clipping as jc
from clipping.test_engine import check, reference, run, setup


# ------------------------------------------------------------------------------------------ convolutions
class MnistCNN(nn.Module):
    """As in Flax's MNIST example (smaller)."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(6, (3, 3), kernel_dilation=(1, 2))(x)), (2, 2), (2, 2))
        return nn.Dense(4)(nn.relu(nn.Dense(8)(x.reshape(x.shape[0], -1))))


class ResBlocks(nn.Module):
    """ResNet-style: strided conv, GroupNorm, a projection shortcut, a grouped conv, circular padding."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.GroupNorm(2)(nn.Conv(4, (3, 3), use_bias=False)(x)))
        y = nn.GroupNorm(2)(nn.Conv(6, (3, 3), strides=2, use_bias=False)(h))
        y = nn.Conv(6, (2, 2), feature_group_count=3, padding="CIRCULAR", kernel_dilation=2)(nn.relu(y))
        h = nn.relu(y + nn.Conv(6, (1, 1), strides=2, name="shortcut")(h))
        return nn.Dense(4)(h.mean(axis=(1, 2)))


class Causal1D(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Conv(5, (3,), padding="CAUSAL", kernel_dilation=2)(x))
        h = nn.Conv(4, (2,), strides=(2,), input_dilation=2, padding=((1, 0),))(h)
        return nn.Dense(3)(h.mean(1))


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,methods,groups", [
    (MnistCNN(), (5, 12, 12, 1), ("auto",), False),
    (ResBlocks(), (5, 8, 8, 3), ("auto",), True),
    pytest.param(ResBlocks(), (5, 8, 8, 3), ("ghost", "ghost-two-pass"), False, marks=pytest.mark.slow),
    (Causal1D(), (5, 9, 2), ("auto", "ghost"), False)], ids=["mnist", "resnet", "resnet-ghost", "causal1d"])
def test_conv_layers_are_tapped_and_exact(model, shape, methods, groups):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1])}
    params, loss_fn, C = setup(model, batch, x, 1)
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in methods:
        check(run(loss_fn, params, batch, l2_clip=C, method=method), ref_sum, ref_norms)
        # in chunks (a loop): conv sites differentiated by `conv_input_grad`, instantiated from patches
        check(run(loss_fn, params, batch, l2_clip=C, method=method, batch_chunk=2), ref_sum, ref_norms)
    if groups:                                                # user-level (pairwise) norms too
        gids = jnp.array([0, 1, 2, 0, 1])
        ref_sum, ref_norms = reference(loss_fn, params, batch, C, group_ids=gids, num_groups=3)
        check(run(loss_fn, params, batch, l2_clip=C, group_ids=gids, num_groups=3), ref_sum, ref_norms)
    plan = jc.explain(loss_fn, params, batch)
    assert plan[-1]["fallback"] == []                        # every conv (and GroupNorm) is tapped
    assert all(r["tapped"] for r in plan[:-1])
    assert {r["layer"] for r in plan[:-1]} >= {"Conv", "Dense"}


# ------------------------------------------------------------------------------------------ validators
class BNNet(nn.Module):
    train: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=not self.train)(nn.Dense(4)(x)))


@pytest.mark.slow
def test_batchnorm_in_training_mode_is_refused_frozen_statistics_are_not():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 5))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0])}
    variables = BNNet(train=False).init(jax.random.PRNGKey(1), x)

    def loss(model):
        def loss_fn(p, b):
            logits = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, b["x"],
                                 mutable=["batch_stats"] if model.train else False)
            logits = logits[0] if model.train else logits
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1)[:, 0]
        return loss_fn

    for method in ("auto", "vmap"):
        with pytest.raises(ValueError, match="GroupNorm"):
            jc.clipped_grad(loss(BNNet(train=True)), variables["params"], batch, l2_clip=1.0, method=method)
    cg = jc.clipped_grad(loss(BNNet(train=False)), variables["params"], batch, l2_clip=1.0)
    assert np.all(np.isfinite(np.asarray(cg.norms)))


class DropNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x)))


@pytest.mark.slow
def test_a_dropout_key_shared_by_all_examples_warns_a_per_example_key_does_not():
    import warnings
    from jdp.clipping.taps import SharedRandomnessWarning
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 5))
    params = DropNet().init(jax.random.PRNGKey(1), x)["params"]
    y = jnp.array([0, 1, 2, 0])
    key = jax.random.PRNGKey(7)

    def nll(logits, y):
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]

    def shared(p, b):        # the key is closed over: every example draws the same mask
        return nll(DropNet().apply({"params": p}, b["x"], rngs={"dropout": key}), b["y"])

    def per_example_key(p, b):
        return nll(DropNet().apply({"params": p}, b["x"], rngs={"dropout": b["key"][0]}), b["y"])

    with pytest.warns(SharedRandomnessWarning, match="jax.random.split"):
        jc.clipped_grad(shared, params, {"x": x, "y": y}, l2_clip=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedRandomnessWarning)
        jc.clipped_grad(per_example_key, params, {"x": x, "y": y, "key": jax.random.split(key, 4)}, l2_clip=1.0)
        # a key derived from the example inside a scan is followed through the loop carry
        from jdp.clipping.taps import shared_random_draws

        def scanned(k, xs):
            def body(c, xi):
                c = jax.random.fold_in(c, xi)
                return c, jax.random.uniform(c)
            return jax.lax.scan(body, k, xs)[1]
        jaxpr = jax.make_jaxpr(scanned)(jax.random.key(0), jnp.arange(3))
        assert shared_random_draws(jaxpr.jaxpr, [False, True]) == 0
        assert shared_random_draws(jaxpr.jaxpr, [False, False]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(padding="VALID", strides=(2, 3)), dict(kernel_dilation=(2, 1), strides=2),
                                dict(padding=((1, 2), (0, 3)), strides=2), dict(padding="SAME_LOWER", strides=2)])
def test_sliced_conv_patches_equal_the_layers_own(kw):
    from jdp.clipping.taps import conv_patches, patches_by_layer
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 9, 8, 3))
    conv = nn.Conv(4, (3, 2), **kw)
    np.testing.assert_array_equal(np.asarray(conv_patches(conv, x)), np.asarray(patches_by_layer(conv, x)))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(strides=2, feature_group_count=2), dict(padding="CIRCULAR", kernel_dilation=2),
                                dict(padding=((1, 0),), input_dilation=2)])
def test_conv_kernel_grads_equal_per_example_gradients_of_the_layer(kw):
    """The transposed-convolution path (no im2col patches) against jax.grad of each example alone."""
    from jdp.clipping.taps import conv_kernel_grads
    one_d = "input_dilation" in kw
    conv = nn.Conv(6, (3,) if one_d else (3, 2), use_bias=False, **kw)
    shape = (4, 1, 10, 4) if one_d else (4, 1, 9, 8, 4)
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    kernel = conv.init(jax.random.PRNGKey(1), x[0])["params"]["kernel"]
    g = jax.random.normal(jax.random.PRNGKey(2), (4,) + conv.apply({"params": {"kernel": kernel}}, x[0]).shape)
    got = conv_kernel_grads(conv, x, g, kernel.shape)
    for b in range(4):
        want = jax.grad(lambda k: jnp.vdot(conv.apply({"params": {"kernel": k}}, x[b]), g[b]))(kernel)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want).reshape(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kw,shape", [
    (dict(), (3, 9, 8, 4)), (dict(padding="VALID", strides=(2, 3)), (3, 9, 8, 4)),
    (dict(kernel_dilation=(2, 1), strides=2), (3, 9, 8, 4)), (dict(padding=((1, 2), (0, 3)), strides=2), (3, 9, 8, 4)),
    (dict(padding="SAME_LOWER", strides=2), (3, 9, 8, 4)), (dict(strides=3, padding="VALID"), (3, 11, 4)),
    (dict(strides=(1, 2, 2)), (2, 5, 6, 7, 3))])
def test_conv_input_grad_equals_autodiff(kw, shape):
    """The explicit flipped-kernel convolution the engine differentiates conv sites with inside a loop."""
    from jdp.clipping.taps import _input_grad_geometry, conv_input_grad
    nd = len(shape) - 2
    conv = nn.Conv(5, (3, 2, 2)[:nd] if nd != 1 else (3,), **kw)
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    kernel = conv.init(jax.random.PRNGKey(1), x)["params"]["kernel"]
    y, vjp = jax.vjp(lambda x: conv.apply({"params": {"kernel": kernel, "bias": jnp.zeros(5)}}, x), x)
    g = jax.random.normal(jax.random.PRNGKey(2), y.shape)
    np.testing.assert_allclose(np.asarray(conv_input_grad(conv, kernel, x, g)), np.asarray(vjp(g)[0]),
                               rtol=1e-5, atol=1e-5)
    assert _input_grad_geometry(conv, kernel, x) is not None


def test_conv_input_grad_leaves_other_convolutions_to_autodiff():
    from jdp.clipping.taps import _input_grad_geometry
    x, k = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))
    assert _input_grad_geometry(nn.Conv(6, (3, 3)), k, x) is not None
    assert _input_grad_geometry(nn.Conv(6, (3, 3), feature_group_count=2), k[:, :, :2], x) is None
    assert _input_grad_geometry(nn.Conv(6, (3, 3), padding="CIRCULAR"), k, x) is None
    assert _input_grad_geometry(nn.Conv(6, (3, 3), input_dilation=2), k, x) is None
    assert _input_grad_geometry(nn.Conv(6, (3, 3)), k.astype(jnp.bfloat16), x) is None
    assert _input_grad_geometry(nn.Conv(6, (3, 3), dtype=jnp.bfloat16), k, x) is None
    assert _input_grad_geometry(nn.Conv(6, (3, 3)), k, x[0]) is None            # no batch axis


@pytest.mark.slow
def test_conv_read_mask_is_where_the_patches_read_the_input():
    """`conv_read_mask` marks exactly the input positions `conv_patches` gathers (the gradient of the
    patches' sum is nonzero there), for strides, dilation, VALID / SAME / explicit padding, 1-D and 2-D."""
    from jdp.clipping.taps import conv_patches, conv_read_mask
    cases = [((3, 3), (2, 2), "VALID", 1), ((3, 3), (2, 2), "SAME", 1), ((2, 3), (3, 1), ((1, 0), (2, 2)), 1),
             ((3, 3), (1, 1), "VALID", 2), ((4,), (3,), "VALID", 1), ((3,), (2,), "SAME_LOWER", 1)]
    for ks, st, pad, dil in cases:
        conv = nn.Conv(2, ks, strides=st, padding=pad, kernel_dilation=dil)
        shape = (2,) + (9,) * len(ks) + (3,)
        x = jnp.ones(shape)
        reached = np.asarray(jax.grad(lambda x: jnp.sum(conv_patches(conv, x)))(x)) != 0
        mask = conv_read_mask(conv, shape)
        np.testing.assert_array_equal(np.broadcast_to(mask, shape), reached, err_msg=str((ks, st, pad, dil)))
    assert conv_read_mask(nn.Conv(2, (3,), padding="CIRCULAR"), (2, 9, 3)) is None


def test_scan_input_counts_under_both_jax_parameter_layouts():
    """jax < 0.11 names a scan's constant and carry counts; later versions pack the inputs as a flat tree
    (consts, carry, xs): both give the same split."""
    from jdp.clipping.taps import _scan_counts

    class FlatTree:  # stand-in for jax's flat tree of a scan's inputs
        def unpack(self):
            return (["c0", "c1"], ["h"], ["x0", "x1", "x2"])

    assert _scan_counts({"num_consts": 2, "num_carry": 1}) == (2, 1)
    assert _scan_counts({"ft_in": FlatTree()}) == (2, 1)
    # and whatever this jax version uses, on a real scan
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda h, x: (h * c + x, h), 0.0, xs))(2.0, jnp.ones(3))
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    assert _scan_counts(eqn.params) == (1, 1)


class _SideReads(nn.Module):
    """Dense layers whose kernels are ALSO read outside the layer: `stop` under stop_gradient (like DPFormer's
    Re-Attention variances), `dead` by code whose result is never used, `live` differentiably."""
    side: str

    @nn.compact
    def __call__(self, x):
        hidden = nn.Dense(8, name="hidden")
        h = jnp.tanh(hidden(x))
        w = hidden.variables["params"]["kernel"]
        if self.side == "stop":
            h = h - jax.lax.stop_gradient(jnp.sum((x * x) @ (w * w), axis=-1, keepdims=True))
        elif self.side == "dead":
            _ = jnp.sum((x * x) @ (w * w))
        else:
            h = h - jnp.sum((x * x) @ (w * w), axis=-1, keepdims=True)
        return nn.Dense(3, name="out")(h)


@pytest.mark.slow
@pytest.mark.parametrize("side, tapped", [("stop", True), ("dead", True), ("live", False)])
def test_a_kernel_read_only_under_stop_gradient_or_by_dead_code_is_tapped_and_exact(side, tapped):
    # a read whose derivative is zero cannot change a per-example gradient, so the layer's site covers the kernel;
    # a differentiable read outside the layer must send it to the exact fallback (else its norm would be missed)
    model = _SideReads(side)
    x = jax.random.normal(jax.random.PRNGKey(3), (6, 5))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1, 2])}
    params, loss_fn, C = setup(model, batch, x, 4)
    summary = jc.explain(loss_fn, params, batch)[-1]
    assert (not any("hidden" in p for p in summary["fallback"])) == tapped, summary["fallback"]
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in ("auto", "ghost", "bk"):
        check(run(loss_fn, params, batch, l2_clip=C, method=method), ref_sum, ref_norms)


class _TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = nn.Dense(4, name="frozen")(x)
        b = nn.Dense(4, name="trained")(x)
        return jnp.sum(a * 2.0 + b ** 2, axis=-1)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True])
def test_a_layer_whose_parameters_pass_through_stop_gradient_is_exact_eagerly_and_jitted(jit):
    # eagerly, stop_gradient returns a concrete array itself: the layer then looks like a tapped layer in the
    # run although the discovery trace (tracers) did not see it as one; it must run as is, not take the next
    # layer's site (which broke the trace or, with matching shapes, could have mixed up two layers' inputs)
    model = _TwoDense()
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
    params = model.init(jax.random.PRNGKey(1), x)

    def loss_fn(p, batch):
        p = {"params": {**p["params"], "frozen": jax.lax.stop_gradient(p["params"]["frozen"])}}
        return model.apply(p, batch)

    ref_sum, ref_norms = reference(loss_fn, params, x, 1.0)
    for method in ("auto", "ghost"):
        f = lambda p: jc.clipped_grad(loss_fn, p, x, l2_clip=1.0, method=method)  # noqa: E731
        res = (jax.jit(f) if jit else f)(params)
        check(res, ref_sum, ref_norms)
        assert not np.asarray(res.grad_sum["params"]["frozen"]["kernel"]).any()
