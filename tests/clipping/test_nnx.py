"""flax.nnx models: the same taps as linen (Linear, Conv, Embed incl. attend, norms), exact against
vmap(grad), and DP-SGD with nnx.Optimizer."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp.clipping as jc
from clipping.test_engine import check, reference


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(2, 6, (3, 3), rngs=rngs)
        self.norm = nnx.GroupNorm(6, num_groups=2, rngs=rngs)
        self.conv2 = nnx.Conv(6, 4, (3, 3), strides=2, padding="VALID", rngs=rngs)
        self.out = nnx.Linear(4 * 3 * 3, 3, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.norm(self.conv1(x)))
        h = nnx.relu(self.conv2(h))
        return self.out(h.reshape(h.shape[0], -1))


class TiedLM(nnx.Module):
    def __init__(self, rngs, vocab=12, dim=8):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.mix = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        h = h + jnp.cumsum(nnx.gelu(self.mix(self.norm(h))), axis=1)   # causal mixing
        return self.embed.attend(h)


def split_loss(model, seq):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p, b):
        lp = jax.nn.log_softmax(nnx.merge(graphdef, p)(b["x"]))
        nll = -jnp.take_along_axis(lp, b["y"][..., None], -1)[..., 0]
        return nll.reshape(nll.shape[0], -1).sum(-1)
    return params, loss_fn


@pytest.mark.parametrize("name", ["cnn", "tied_lm"])
def test_nnx_layers_are_tapped_and_exact(name):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    if name == "cnn":
        model, batch = CNN(nnx.Rngs(1)), {"x": jax.random.normal(k1, (5, 8, 8, 2)),
                                           "y": jnp.array([0, 1, 2, 0, 1])}
    else:
        model, batch = TiedLM(nnx.Rngs(1)), {"x": jax.random.randint(k1, (5, 6), 0, 12),
                                              "y": jax.random.randint(k2, (5, 6), 0, 12)}
    params, loss_fn = split_loss(model, name == "tied_lm")
    C = float(np.median(reference(loss_fn, params, batch, 1e6)[1]))
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in ("auto", "ghost"):
        check(jax.jit(lambda p, b, m=method: jc.clipped_grad(loss_fn, p, b, l2_clip=C, method=m))(params, batch),
              ref_sum, ref_norms)
    plan = jc.explain(loss_fn, params, batch)
    assert plan[-1]["fallback"] == [] and all(r["tapped"] for r in plan[:-1])
    kinds = {r["kind"] for r in plan[:-1]}
    assert kinds == ({"conv", "local", "dense"} if name == "cnn" else {"lookup", "attend", "local", "dense"})


def test_nnx_batchnorm_in_training_mode_is_refused():
    class BN(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x)).sum(-1)

    graphdef, params, rest = nnx.split(BN(nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(p, b):
        return nnx.merge(graphdef, p, rest)(b)
    with pytest.raises(ValueError, match="GroupNorm"):
        jc.clipped_grad(loss_fn, params, jnp.ones((4, 3)), l2_clip=1.0)


def test_dp_sgd_with_nnx_optimizer():
    n, C = 64, 0.5
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    data = {"x": jax.random.normal(k1, (n, 8, 8, 2)), "y": jax.random.randint(k2, (n,), 0, 3)}
    model = CNN(nnx.Rngs(0))
    graphdef, _ = nnx.split(model, nnx.Param)

    def loss_fn(p, b):
        lp = jax.nn.log_softmax(nnx.merge(graphdef, p)(b["x"]))
        return -jnp.take_along_axis(lp, b["y"][:, None], 1)[:, 0]

    dp = jc.dp_sgd(loss_fn, optax.adam(1e-2), num_examples=n, batch_size=16, l2_clip=C, epsilon=2.0,
                   delta=1e-5, steps=3)
    optimizer = nnx.Optimizer(model, dp.transform(jax.random.PRNGKey(7)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch, mask):
        params = nnx.state(model, nnx.Param)
        cg = jc.clipped_grad(loss_fn, params, batch, l2_clip=C, mask=mask)
        optimizer.update(model, cg.grad_sum)      # noise (dp_aggregate) + Adam
        return cg.norms

    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    for key in jax.random.split(jax.random.PRNGKey(11), dp.steps):
        idx, mask = dp.sample(key)
        norms = train_step(model, optimizer, jax.tree.map(lambda a: a[idx], data), mask)
        assert np.all(np.asarray(norms)[~np.asarray(mask, bool)] == 0)
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    assert all(np.any(a != b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    assert dp.report().epsilon() <= 2.0 + 1e-9
