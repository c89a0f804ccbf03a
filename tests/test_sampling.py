"""jdp.sampling: the one Poisson sampler of DP-SGD, task-weighted noisy GD and the meta-learning engine."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from jdp import sampling
from jdp.meta import engine as meta_engine
from jdp.multitask import noisy_gd


def test_every_poisson_sampled_loop_uses_the_one_sampler():
    dp_sgd = importlib.import_module("jdp.clipping.dp_sgd")  # (the package's `dp_sgd` is the function)
    assert dp_sgd.poisson_keep is sampling.poisson_keep
    assert noisy_gd.poisson_keep is sampling.poisson_keep
    assert meta_engine.poisson_keep is sampling.poisson_keep


def test_poisson_keep_draws_uniforms_below_the_rate_also_for_a_traced_rate():
    key = jax.random.key(3)
    want = np.asarray(jax.random.uniform(key, (500,)) < 0.2)
    np.testing.assert_array_equal(np.asarray(sampling.poisson_keep(key, 500, 0.2)), want)
    traced = jax.jit(lambda k, q: sampling.poisson_keep(k, 500, q))(key, jnp.float32(0.2))
    np.testing.assert_array_equal(np.asarray(traced), want)
    assert 60 < want.sum() < 140


def test_poisson_indices_and_the_padded_sample_hold_the_same_rows():
    key = jax.random.key(7)
    rows = sampling.poisson_indices(key, 200, 0.1)
    np.testing.assert_array_equal(rows, np.flatnonzero(np.asarray(sampling.poisson_keep(key, 200, 0.1))))
    idx, mask, count = sampling.poisson_sample_jit(key, 200, 0.1, 64)
    assert int(count) == rows.size and int(mask.sum()) == rows.size
    np.testing.assert_array_equal(np.asarray(idx)[np.asarray(mask)], rows)
    assert not np.asarray(idx)[~np.asarray(mask)].any()  # padding repeats row 0, masked out
