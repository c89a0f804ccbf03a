"""A loss that mixes the examples of its batch (x - x.mean(0), batch statistics) is refused at the first call of
`clipped_grad`: the engine evaluates the loss one example at a time, so it would silently train a different model
and per-example clipping would bound nothing. The check reads only the function's structure (public synthetic
inputs of the batch's shapes), runs once per function and shapes, and leaves per-example losses alone."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp.clipping as jc
from jdp.clipping import engine, mixing


class Net(nn.Module):
    center: str = "none"  # "none" | "mean" (x - x.mean(0)) | "batchstats" ((x - mean) / std over the batch)

    @nn.compact
    def __call__(self, x):
        if self.center == "mean":
            x = x - x.mean(0)
        h = nn.relu(nn.Dense(8)(x))
        if self.center == "batchstats":
            h = (h - h.mean(0)) / (h.std(0) + 1e-3)
        return nn.Dense(1)(h)[..., 0]


def _setup(center, n=8, seed=0):
    model = Net(center)
    x = jax.random.normal(jax.random.key(seed), (n, 5))
    params = model.init(jax.random.key(1), x[:1])

    def loss_fn(p, b):
        return (model.apply(p, b["x"]) - b["y"]) ** 2
    return loss_fn, params, {"x": x, "y": jnp.zeros(n)}


@pytest.mark.parametrize("center", ["mean", "batchstats"])
def test_a_loss_that_mixes_examples_is_refused_eagerly_and_under_jit(center):
    loss_fn, params, batch = _setup(center)
    for method in ("auto", "vmap"):
        with pytest.raises(ValueError, match="mixes the examples of its batch"):
            jc.clipped_grad(loss_fn, params, batch, l2_clip=1.0, method=method)
    loss_fn, params, batch = _setup(center)  # a fresh function: refused at trace time of a jitted step
    with pytest.raises(ValueError, match="LayerNorm / GroupNorm"):
        jax.jit(lambda p, b: jc.clipped_grad(loss_fn, p, b, l2_clip=1.0).grad_sum)(params, batch)


def test_dp_sgd_refuses_a_mixing_loss_before_its_first_step():
    loss_fn, params, batch = _setup("mean")
    dp = jc.dp_sgd(loss_fn, optax.sgd(0.1), num_examples=8, batch_size=4, l2_clip=1.0, delta=1e-3, steps=2,
                   noise_multiplier=1.0)
    with pytest.raises(ValueError, match="mixes the examples"):
        dp.fit(params, batch, jax.random.key(2), progress=False)


def test_the_check_reads_structure_not_the_batch_values():
    # every example identical: x - x.mean(0) is exactly 0 on this batch, so comparing the batch's own values would
    # see nothing; the synthetic inputs still show the mixing. Ids mixed through an embedding are caught too.
    loss_fn, params, batch = _setup("mean")
    same = {"x": jnp.ones((8, 5)), "y": jnp.zeros(8)}
    with pytest.raises(ValueError, match="mixes the examples"):
        jc.clipped_grad(loss_fn, params, same, l2_clip=1.0)

    class Bag(nn.Module):
        @nn.compact
        def __call__(self, ids):
            e = nn.Embed(7, 4)(ids).mean(1)
            return nn.Dense(1)(e - e.mean(0))[..., 0]

    ids = jnp.zeros((6, 3), jnp.int32)
    bag = Bag()
    p = bag.init(jax.random.key(0), ids[:1])
    with pytest.raises(ValueError, match="mixes the examples"):
        jc.clipped_grad(lambda q, b: bag.apply(q, b["ids"]) ** 2, p, {"ids": ids}, l2_clip=1.0)


def test_per_example_losses_pass_with_dropout_keys_and_aux():
    _, _, batch = _setup("none")

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x)))[..., 0]

    drop = Drop()
    x = batch["x"]
    p = drop.init(jax.random.key(0), x[:1])
    # the documented convention: one key per example, the loss draws with the batch's first key (typed or raw)
    for keys in (jax.random.split(jax.random.key(3), 8), jax.random.split(jax.random.PRNGKey(3), 8)):
        engine.check_per_example_loss(lambda q, b: drop.apply(q, b["x"], rngs={"dropout": b["key"][0]}) ** 2, p,
                                      {"x": x, "key": keys})

    def with_aux(q, b, aux):  # a shared public value (a tracer inside the jitted step) is no mixing
        return (drop.apply(q, b["x"], rngs={"dropout": b["key"][0]}) * aux["scale"]) ** 2
    dp = jc.dp_sgd(with_aux, optax.sgd(0.1), num_examples=80, batch_size=8, l2_clip=1.0, delta=1e-3, steps=2,
                   noise_multiplier=1.0, method="vmap")
    keyed = {"x": x, "key": jax.random.split(jax.random.key(3), 8)}
    _, sums = dp.accumulate(p, jax.tree.map(jnp.zeros_like, p), keyed, jnp.ones(8, bool), {"scale": jnp.float32(2.0)})
    assert float(sums["count"]) == 8


def test_batchnorm_keeps_its_own_message():
    class BN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x)))[..., 0]

    x = jax.random.normal(jax.random.key(0), (4, 5))
    variables = BN().init(jax.random.key(1), x)

    def loss_fn(p, b):
        out, _ = BN().apply({"params": p, "batch_stats": variables["batch_stats"]}, b["x"], mutable=["batch_stats"])
        return out ** 2
    with pytest.raises(ValueError, match="BatchNorm .* runs in training mode"):
        jc.clipped_grad(loss_fn, variables["params"], {"x": x}, l2_clip=1.0)


@pytest.mark.slow
def test_the_check_runs_once_per_function_and_structure(monkeypatch):
    calls = []
    real = mixing._mixing_losses

    def counting(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(mixing, "_mixing_losses", counting)  # the check lives in jdp.clipping.mixing
    loss_fn, params, batch = _setup("none")
    cg = jc.clipped_grad(loss_fn, params, batch, l2_clip=1.0, method="vmap")
    assert np.all(np.isfinite(np.asarray(cg.norms)))
    engine.check_per_example_loss(loss_fn, params, batch)
    half = jax.tree.map(lambda a: a[:4], batch)  # another batch size, the same per-example shapes: cached
    engine.check_per_example_loss(loss_fn, params, half)
    assert len(calls) == 1
    bag_p = {"params": {"t": jnp.zeros((7, 2))}}

    def bag(q, b):
        return q["params"]["t"][b["ids"]].sum((1, 2))
    for length in (3, 5, 9):  # another window length of the same structure: cached (one check per function)
        engine.check_per_example_loss(bag, bag_p, {"ids": jnp.zeros((6, length), jnp.int32)})
    assert len(calls) == 2
    other = {"x": batch["x"], "y": jnp.zeros((8,), jnp.int32)}  # another dtype: checked again
    engine.check_per_example_loss(loss_fn, params, other)
    assert len(calls) == 3
