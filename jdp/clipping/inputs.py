"""The checks of `clipped_grad`'s arguments: the batch size, the parameters, the parameter groups with their clip
bounds, the mask and the group_ids units (`_Part`: one batch, or one chunk of a loop, as the engine clips it).
Every invalid argument raises a ValueError naming it."""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdp.validation import check_positive


class _Part(NamedTuple):
    """One batch, or one chunk of a loop, as `_clip_batch` clips it."""
    batch: Any
    w: jax.Array                  # [B] 0/1 row indicator
    group_ids: jax.Array | None   # [B] unit of each row (None: each row its own unit)
    num_units: int                # N


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _batch_size(batch) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch must contain at least one array with a leading batch axis")
    sizes = {int(np.shape(x)[0]) if np.ndim(x) > 0 else None for x in leaves}
    if None in sizes:
        raise ValueError("every array in batch must have a leading batch axis; got a scalar")
    if len(sizes) != 1:
        raise ValueError(f"batch arrays have mismatched leading (batch) sizes {sorted(sizes)}")
    B = sizes.pop()
    if B < 1:
        raise ValueError("batch is empty (batch size 0)")
    return B


def _partition(params, clip_partition) -> tuple[list[int], tuple]:
    """Label index per flattened leaf and the ordered label tuple."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if clip_partition is None:
        return [0] * len(paths), ("all",)
    if clip_partition == "per_layer":
        labels = [jax.tree_util.keystr(p[:-1]) if len(p) > 1 else jax.tree_util.keystr(p) for p in paths]
    elif callable(clip_partition):
        labels = [clip_partition(p) for p in paths]
    else:
        labels = jax.tree.leaves(jax.tree.map(lambda _, lab: lab, params, clip_partition))
        if len(labels) != len(paths):
            raise ValueError("clip_partition must be a pytree of labels with the structure of params")
    order = tuple(dict.fromkeys(labels))
    return [order.index(lab) for lab in labels], order


def _clip_values(l2_clip, labels: tuple) -> np.ndarray:
    if isinstance(l2_clip, Mapping):
        missing = [lab for lab in labels if lab not in l2_clip]
        if missing:
            raise ValueError(f"l2_clip has no threshold for parameter groups {missing}")
        return np.array([check_positive(l2_clip[lab], f"l2_clip[{lab!r}]") for lab in labels], np.float64)
    C = check_positive(l2_clip, "l2_clip")
    return np.full(len(labels), C / math.sqrt(len(labels)))



def _check_params(params, method) -> tuple[list, Any]:
    """(leaves, treedef) of `params` after checking they are floating-point (float32 or wider for ghost-two-pass)."""
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        raise ValueError("params is empty")
    for x in leaves:
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError("params must contain only floating-point arrays")
    if method == "ghost-two-pass" and any(jnp.finfo(jnp.result_type(x)).bits < 32 for x in leaves):
        raise ValueError("method='ghost-two-pass' forms the clipped sum by a second backward in the parameters' "
                         "dtype; with bfloat16/float16 parameters that sum would round to 8-11 bits: use "
                         "method='auto' (the sum is formed in float32, see docs/clipping.md#mixed-precision)")
    return leaves, treedef


def _units(mask, group_ids, num_groups, B: int) -> _Part:
    """The row indicator w [B], group_ids and the number of units N of a call (its batch filled in later), after
    checking `mask` and `group_ids`."""
    if mask is None:
        w = jnp.ones((B,), jnp.float32)
    else:
        mask = jnp.asarray(mask)
        if mask.shape != (B,):
            raise ValueError(f"mask must have shape ({B},) like the batch, got {mask.shape}")
        if _is_concrete(mask) and not np.all(np.isin(np.asarray(mask), (0, 1))):
            raise ValueError("mask must hold only 0/1 (or bool) values: a weight other than 1 would scale an "
                             "example's clipped gradient beyond the sensitivity")
        w = (mask != 0).astype(jnp.float32)   # a 0/1 indicator, never a weight
    if group_ids is None:
        return _Part(None, w, None, B)
    group_ids = jnp.asarray(group_ids)
    if group_ids.shape != (B,) or not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be an integer array of shape ({B},), got "
                         f"{group_ids.dtype}{tuple(group_ids.shape)}")
    N = B if num_groups is None else int(num_groups)
    if N < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if _is_concrete(group_ids) and (np.asarray(group_ids).min() < 0 or np.asarray(group_ids).max() >= N):
        raise ValueError(f"group_ids must lie in [0, num_groups={N})")
    # (under jit) an id outside [0, N) belongs to no unit: the example is dropped, never clipped
    # with another unit's factor
    w = jnp.where((group_ids >= 0) & (group_ids < N), w, 0.0)
    return _Part(None, w, group_ids, N)
