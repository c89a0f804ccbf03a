"""Poisson sampling, the one batch sampler of every private loop in jdp (DP-SGD, task-weighted noisy GD, the
meta-learning engine): each unit joins a step's sample independently with probability q, which is what
dp_accounting's `PoissonSampledDpEvent(q, ...)` accounts. Static-shape layouts (padding + mask) for jit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def poisson_keep(key: jax.Array, num_examples: int, sampling_rate: float | jax.Array) -> jax.Array:
    """[num_examples] bool: each row in the sample independently with probability sampling_rate (the one
    sampling rule of every Poisson-sampled step in jdp). `sampling_rate` may be traced."""
    return jax.random.uniform(key, (num_examples,)) < sampling_rate


def poisson_indices(key: jax.Array, num_examples: int, sampling_rate: float) -> np.ndarray:
    """All rows of one Poisson sample (`poisson_keep`), variable size, on the host: for callers that lay a
    sample out in their own physical chunks and `DPSGD.accumulate` them."""
    return np.flatnonzero(np.asarray(_keep_jit(key, int(num_examples), float(sampling_rate))))


def poisson_sample(key: jax.Array, num_examples: int, sampling_rate: float, max_batch_size: int):
    """Poisson sample of row indices padded to a static size.

    Returns (indices [max_batch_size] int32, mask [max_batch_size] bool, count []). Padding rows repeat
    index 0 with mask False. When count > max_batch_size the indices are truncated, which does NOT match
    the accounted mechanism: use `DPSGD.sample`, which then pads to a larger multiple instead (never
    truncating, never raising).
    """
    keep = poisson_keep(key, num_examples, sampling_rate)
    count = jnp.sum(keep)
    (idx,) = jnp.nonzero(keep, size=max_batch_size, fill_value=0)
    mask = jnp.arange(max_batch_size) < count
    return idx.astype(jnp.int32), mask, count


poisson_sample_jit = jax.jit(poisson_sample, static_argnums=(1, 2, 3))
_keep_jit = jax.jit(poisson_keep, static_argnums=(1, 2))

__all__ = ["poisson_indices", "poisson_keep", "poisson_sample", "poisson_sample_jit"]
