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

In a DP-SGD run: `dp_sgd(..., sparse_rows=SparseRows(table=..., ids=...))`. The run's noise multiplier σ is
calibrated as for plain DP-SGD (same event) and split into σ_g and σ_r = ratio·σ_g with (σ_g⁻² + σ_r⁻²)^(-1/2) = σ
(`split_noise`); each chunk's `accumulate` also sums the counts of the rows its units touch, and `apply`
(`dp_sgd.dp_aggregate`) selects, adds the noise and zeroes the table's other rows. Rows a unit touches are what the
caller's `ids` says (e.g. a sequence model's input and target items); gradient that reaches other rows (a full
softmax over a tied table reaches every row) is dropped with them: a projection, which never adds sensitivity.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

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


# ---------------------------------------------------------------------------------------------------
# In a DP-SGD run.
@dataclasses.dataclass(frozen=True)
class SparseRows:
    """DP-FEST on one embedding table of a DP-SGD run (`dp_sgd(..., sparse_rows=SparseRows(...))`).

    table: the names on the path of the table's leaf in the parameters, e.g. ("params", "item_embed",
      "embedding") for a linen `nn.Embed(name="item_embed")` (its rows: the leaf's first axis);
    ids: batch -> [units, positions] integer ids of the rows each unit touches (any values: see `row_counts`);
    ratio: σ_r / σ_g, public (larger: a noisier selection and a less noisy gradient);
    threshold: τ in units of σ_r, public: a row with no unit is selected with probability P(N(0,1) > τ);
    pad_id: the id that is no row (None: every id in range is a row)."""
    table: tuple
    ids: Callable[[Any], jax.Array]
    ratio: float = 2.0
    threshold: float = 3.0
    pad_id: int | None = 0

    def __post_init__(self):
        if isinstance(self.table, str) or not self.table or not all(isinstance(n, str) for n in self.table):
            raise ValueError(f"table must be a non-empty tuple of names (a path in the parameters), got {self.table!r}")
        object.__setattr__(self, "table", tuple(self.table))
        if not callable(self.ids):
            raise ValueError("ids must be a function batch -> [units, positions] row ids")
        check_positive(self.ratio, "ratio")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be finite, got {self.threshold!r}")

    def is_table(self, path) -> bool:
        return _names(path) == self.table

    def n_rows(self, params) -> int:
        """The table's row count; ValueError (before any work) when `params` has no such 2-d+ leaf."""
        found = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if self.is_table(p)]
        if len(found) != 1 or jnp.ndim(found[0]) < 2:
            raise ValueError(f"sparse_rows: no embedding table at {'/'.join(self.table)} in the parameters")
        return int(jnp.shape(found[0])[0])

    def counts(self, params, batch, mask) -> jax.Array:
        """The chunk's contribution counts (`row_counts` of the units' ids, weighted by the sample's mask). `ids`
        runs on each unit alone (vmapped over a batch of one), so a unit's rows come from its own data only,
        whatever the function does across rows."""
        ids = jax.vmap(lambda unit: jnp.asarray(self.ids(jax.tree.map(lambda x: x[None], unit)))[0])(batch)
        return row_counts(ids.reshape(ids.shape[0], -1), mask, self.n_rows(params), self.pad_id)


def _names(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def split_noise(noise_multiplier: float, ratio: float) -> tuple[float, float]:
    """(σ_g, σ_r): the gradient's and the selection's noise multipliers with σ_r = ratio·σ_g whose one equivalent
    Gaussian (`step_noise_multiplier`) has multiplier `noise_multiplier`."""
    s = check_positive(noise_multiplier, "noise_multiplier")
    r = check_positive(ratio, "ratio")
    g = s * math.sqrt(1.0 + r ** -2)
    return g, r * g


__all__ = ["SparseRows", "noisy_selected_rows", "row_counts", "select_rows", "split_noise", "step_event",
           "step_noise_multiplier"]
