"""Sparsity-preserving DP updates of embedding tables (DP-FEST: Ghazi et al., "Sparsity-preserving differentially
private training of large embedding models", NeurIPS 2023): the mechanism's parts, as pure functions.

Per DP-SGD step, the rows of a table that the sampled units touch are selected privately, and the step's Gaussian
noise is added to those rows only; every other row gets a zero update (no noise walk on rows nobody used).

- Contribution counts (`row_counts`): each unit's set of DISTINCT valid row ids (ids outside [0, n_rows) and the
  padding id are no rows) as an indicator vector scaled by 1/√n (n: its number of distinct rows), summed over the
  sampled units. One unit's vector has L2 norm exactly 1 (0 without rows), so adding or removing a unit moves the
  sum by at most 1: a Gaussian mechanism with sensitivity 1. In float32 its n entries are 1/√n by a correctly
  rounded sqrt and division (relative error ≤ 2·2⁻²⁴), so its norm is ≤ 1 + 2⁻²² (tests/privacy/test_sparse_rows_privacy.py).
- Selection (`select_rows`): the counts plus N(0, σ_r²) per row, kept where above a threshold τ (public).
- Noise on the selected rows only (`noisy_selected_rows`): the table's clipped gradient sum restricted to them
  plus N(0, (σ_g·C)²) on each of their entries.

Unit and relation: those of the DP-SGD step it joins (add/remove one unit, Poisson sampling). The step releases
(the selection, the noisy sum on the selected rows): two Gaussian mechanisms on the same sample with sensitivities 1
and C, i.e. one Gaussian on their concatenation, each part scaled to sensitivity 1, with noise multiplier
(σ_r⁻² + σ_g⁻²)^(-1/2) (`step_noise_multiplier`), Poisson-subsampled at rate q (`step_event`). Restricting the
noisy sum to the selected rows is post-processing of the selection.
"""
from __future__ import annotations

import math

import dp_accounting.dp_event as dpe
import jax
import jax.numpy as jnp

from jdp.validation import check_positive


def row_counts(ids: jax.Array, weights: jax.Array, n_rows: int, pad_id: int | None = 0) -> jax.Array:
    """[n_rows] float32: Σ over units b of weights[b] · (1/√n_b on each distinct valid row of ids[b]).

    ids [B, T] integers (any values: those outside [0, n_rows) and `pad_id` count as no row); weights [B]: the
    Poisson sample's mask, clipped to [0, 1] (NaN: 0), since a weight scales its unit's norm. The float32 sum over
    units rounds as any float32 sum (not covered, docs/privacy.md#floating-point-what-the-clipping-bound-guarantees)."""
    if isinstance(n_rows, bool) or int(n_rows) != n_rows or n_rows < 1:
        raise ValueError(f"n_rows must be a positive integer, got {n_rows!r}")
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer array [units, positions], got {ids.dtype} {ids.shape}")
    valid = (ids >= 0) & (ids < n_rows)
    if pad_id is not None:
        valid &= ids != pad_id
    # distinct rows of each unit: sort its valid ids (invalid ones to the end as n_rows), keep first occurrences
    keyed = jnp.sort(jnp.where(valid, ids, n_rows), axis=1)
    first = jnp.concatenate([jnp.ones_like(keyed[:, :1], bool), keyed[:, 1:] != keyed[:, :-1]], axis=1)
    distinct = first & (keyed < n_rows)
    n = jnp.sum(distinct, axis=1)
    # 1/√n by a correctly rounded sqrt and division (XLA's rsqrt may be off by more than half an ulp)
    scale = jnp.where(n > 0, 1.0 / jnp.sqrt(jnp.maximum(n, 1).astype(jnp.float32)), 0.0)
    weights = jnp.asarray(weights, jnp.float32)
    weights = jnp.where(jnp.isnan(weights), 0.0, jnp.clip(weights, 0.0, 1.0))  # a weight scales its unit's norm
    w = weights[:, None] * scale[:, None] * distinct
    return jnp.zeros(n_rows, jnp.float32).at[jnp.where(distinct, keyed, 0)].add(w, mode="drop")


def select_rows(key: jax.Array, counts: jax.Array, noise_std: float, threshold: float) -> jax.Array:
    """[n_rows] bool: rows whose counts plus N(0, noise_std²) exceed `threshold` (the private selection)."""
    std = check_positive(noise_std, "noise_std")
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be finite, got {threshold!r}")
    return counts + std * jax.random.normal(key, counts.shape, jnp.float32) > threshold


def noisy_selected_rows(key: jax.Array, grad_sum: jax.Array, selected: jax.Array, noise_std: float) -> jax.Array:
    """The table's clipped gradient sum [n_rows, ...] plus N(0, noise_std²) on the selected rows, zero elsewhere."""
    std = check_positive(noise_std, "noise_std")
    g = jnp.asarray(grad_sum, jnp.promote_types(grad_sum.dtype, jnp.float32))
    noisy = g + std * jax.random.normal(key, g.shape, g.dtype)
    return jnp.where(selected.reshape((-1,) + (1,) * (g.ndim - 1)), noisy, jnp.zeros((), g.dtype))


def step_noise_multiplier(gradient_noise_multiplier: float, selection_noise_multiplier: float) -> float:
    """The noise multiplier of one Gaussian equivalent to the selection (sensitivity 1, σ_r) and the gradient
    (sensitivity C, σ_g·C) released on the same sample: (σ_r⁻² + σ_g⁻²)^(-1/2)."""
    g = check_positive(gradient_noise_multiplier, "gradient_noise_multiplier")
    r = check_positive(selection_noise_multiplier, "selection_noise_multiplier")
    return float((g ** -2 + r ** -2) ** -0.5)


def step_event(sampling_rate: float, gradient_noise_multiplier: float, selection_noise_multiplier: float,
               steps: int = 1) -> dpe.DpEvent:
    """dp_accounting event of `steps` DP-FEST steps at Poisson rate q (add/remove one unit)."""
    q = check_positive(sampling_rate, "sampling_rate")
    if q > 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {q}")
    one = dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(
        step_noise_multiplier(gradient_noise_multiplier, selection_noise_multiplier)))
    return one if steps == 1 else dpe.SelfComposedDpEvent(one, int(steps))


__all__ = ["noisy_selected_rows", "row_counts", "select_rows", "step_event", "step_noise_multiplier"]
