"""Data-parallel clipping over a device mesh: each device clips its own rows, one `psum` adds the clipped sums.

Why this keeps DP-SGD's guarantee unchanged: a unit (a row) lives on exactly one device, where the engine
clips it as it would on one device, so adding or removing it moves that device's clipped sum, and hence the
all-reduced sum, by at most C (`clipped_grad`'s bound; the all-reduce only adds partial sums, like the engine's
own chunks). The noise is added AFTER the reduction, on the replicated sum, from the replicated key held in the
optimizer state: every device computes the same draw, so the release carries one N(0, (σC)²) sample, never one
per device (which would be a different mechanism, and with independent keys a weaker one per device).

Units are rows. Per-user clipping over examples that may sit on different devices (`group_ids`) is not offered
here: make each row one user's whole data, as `jdp.seqrec` does, and the row is the unit on any mesh.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def data_mesh(num_devices: int | None = None, axis: str = DATA_AXIS) -> Mesh:
    """A 1-d mesh named `axis` over the first `num_devices` of `jax.devices()` (None: all of them; with
    `jax.distributed` initialised, the devices of every process)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else int(num_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices must be in [1, {len(devices)}], got {num_devices}")
    return Mesh(np.asarray(devices[:n]), (axis,))


def check_mesh(mesh: Mesh | None, axis: str, max_batch_size: int | None = None) -> None:
    """Refuses a mesh without `axis`, or a padded batch that does not split evenly over it (shapes are public)."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has axes {mesh.axis_names}, not the data axis {axis!r} (see data_axis)")
    n = mesh.shape[axis]
    if max_batch_size is not None and max_batch_size % n:
        raise ValueError(f"max_batch_size={max_batch_size} must be a multiple of the {n} devices on mesh axis "
                         f"{axis!r} (each device clips an equal share of the padded batch)")


def row_sharding(mesh: Mesh, axis: str = DATA_AXIS) -> NamedSharding:
    """Rows split over `axis`, everything else replicated: where a batch should live before the step."""
    return NamedSharding(mesh, PartitionSpec(axis))


def sharded_sums(fn: Callable, mesh: Mesh, axis: str) -> Callable:
    """fn(params, batch, mask, aux) -> (grad_sum, sums) run on every device's rows of (batch, mask), its outputs
    summed over `axis` and replicated. params and aux are replicated."""
    rows, rep = PartitionSpec(axis), PartitionSpec()
    n = mesh.shape[axis]

    def body(params, batch, mask, aux):
        return jax.lax.psum(fn(params, batch, mask, aux), axis)

    def run(params: Any, batch: Any, mask: jax.Array, aux: Any = None):
        sizes = {int(x.shape[0]) for x in jax.tree.leaves((batch, mask))}
        if any(s % n for s in sizes):
            raise ValueError(f"a batch of {sorted(sizes)} rows does not split over the {n} devices of mesh axis "
                             f"{axis!r}: pad it to a multiple of {n} with masked-out rows")
        return jax.shard_map(body, mesh=mesh, in_specs=(rep, rows, rows, rep), out_specs=rep,
                             check_vma=False)(params, batch, mask, aux)
    return run


__all__ = ["DATA_AXIS", "check_mesh", "data_mesh", "row_sharding", "sharded_sums"]
