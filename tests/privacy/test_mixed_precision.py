"""Mixed precision: a model in bfloat16 (parameters, activations, matmuls) is clipped with its norms and its
clipped sum in float32, and DP-SGD adds float32 noise before casting to the parameters' dtype.

The attack: a batch of many units already at the clip bound, all pushing the same coordinates, and one more unit
whose clipped gradient (norm ≤ C) is spread so that every coordinate of the sum crosses a rounding boundary. Rounded
to bfloat16 (what `grad_sum` used to be for bfloat16 parameters) the sum with and without that unit differ by many
times C; in float32 by C plus float32's rounding of the batch sum (documented residual, ~2⁻²³·‖sum‖)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp.clipping as jc
from jdp.clipping import dp_sgd
from jdp.clipping.dp_sgd import dp_aggregate

C = 1.0
D = 32


class Bf16Dense(nn.Module):
    features: int = D

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)


def _loss(model):
    def loss_fn(p, b):
        return jnp.sum(model.apply(p, b["x"]).astype(jnp.float32) * b["c"], axis=1)
    return loss_fn


def _sums(params, loss_fn, x, c, mask):
    return jax.jit(lambda m: jc.clipped_grad(loss_fn, params, {"x": jnp.asarray(x), "c": jnp.asarray(c)},
                                             l2_clip=C, mask=m).grad_sum)(jnp.asarray(mask))


def _diff(a, b, dtype):
    d = [np.asarray(jnp.asarray(x, dtype), np.float64) - np.asarray(jnp.asarray(y, dtype), np.float64)
         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return float(np.sqrt(sum(np.sum(x * x) for x in d)))


def test_bfloat16_model_gets_a_float32_clipped_sum_that_one_unit_moves_by_at_most_c():
    """Rows 0..M-1: one big example repeated, each clipped to C, so that every entry of the kernel's sum sits just
    below the bfloat16 rounding midpoint 15.96875 (between 15.9375 and 16); row M: the attacker, a nudge of norm ≪ C.
    Rounded to bfloat16 the nudge flips each of the 64² entries by one ulp (1/16): ‖diff‖ ≈ 4C."""
    model = Bf16Dense(64)
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))
    loss_fn = _loss(model)
    M, mid = 1022, 15.96875                          # a clipped big row adds C/64 to each entry: M/64 = mid
    x = np.zeros((M + 2, 64), np.float32)            # (row M+1: padding, masked out)
    c = np.zeros((M + 2, 64), np.float32)
    x[:M], c[:M] = 10.0, 10.0
    mask = np.zeros(M + 2, bool)
    mask[:M] = True
    without = _sums(params, loss_fn, x, c, mask)
    gap = mid - np.asarray(without["params"]["Dense_0"]["kernel"], np.float64)
    assert 0 < gap.min() and gap.max() < 1e-3, gap   # below the midpoint (the bound's slack), not by much
    x[M] = c[M] = np.sqrt(4 * gap.max())             # the attacker: each entry of its gradient 4·gap
    mask[M] = True
    with_u = _sums(params, loss_fn, x, c, mask)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(with_u))
    in_f32 = _diff(with_u, without, jnp.float32)
    in_bf16 = _diff(with_u, without, jnp.bfloat16)   # the sum as it used to be returned for bfloat16 parameters
    assert in_f32 <= C * (1 + 1e-4), in_f32
    assert in_f32 < 0.1 * C                          # the nudge itself is small ...
    assert in_bf16 > 2 * C, in_bf16                  # ... but flips every bfloat16 entry: the attack has teeth


def test_dp_aggregate_adds_float32_noise_then_casts_to_the_parameters_dtype():
    params = {"w": jnp.zeros((1000,), jnp.bfloat16)}
    upd = {"w": jnp.full((1000,), 0.3, jnp.float32)}
    tx = dp_aggregate(1.0, 1.0, 1.0, jax.random.key(3))
    out, _ = tx.update(upd, tx.init(params), params)
    assert out["w"].dtype == jnp.bfloat16
    raw, _ = tx.update(upd, tx.init(params))          # no params: the float32 release itself
    assert raw["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(raw["w"].astype(jnp.bfloat16)))
    assert len(np.unique(np.asarray(raw["w"]))) > 900   # a float32 Gaussian, not 8-bit values


def test_dp_sgd_trains_a_bfloat16_model():
    model = Bf16Dense()
    x = np.random.default_rng(1).normal(size=(128, D)).astype(np.float32)
    data = {"x": x, "c": np.ones((128, D), np.float32)}
    params = model.init(jax.random.key(0), x[:1])

    loss_fn = _loss(model)
    dp = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=128, batch_size=16, l2_clip=C, delta=1e-3, steps=2,
                noise_multiplier=1.0)
    out, _, hist = dp.fit(params, data, jax.random.key(1), progress=False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
    assert not np.array_equal(np.asarray(out["params"]["Dense_0"]["kernel"], np.float32),
                              np.asarray(params["params"]["Dense_0"]["kernel"], np.float32))


def test_ghost_two_pass_refuses_bfloat16_parameters():
    model = Bf16Dense()
    params = model.init(jax.random.key(0), jnp.ones((1, D)))
    with pytest.raises(ValueError, match="ghost-two-pass"):
        jc.clipped_grad(lambda p, b: jnp.sum(model.apply(p, b).astype(jnp.float32), 1), params,
                        jnp.ones((4, D)), l2_clip=1.0, method="ghost-two-pass")
