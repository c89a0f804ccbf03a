"""Per-task weighted Gram matrices A_i = Σ_j w_ij x_j x_jᵀ and b_i = Σ_j w_ij y_ij x_j, fast.

The observation structure Ω is fixed across training steps, so a host-side `GramPlan` is built once.
Tasks are bucketed by their number of observations into length classes growing by ≈√2 (padding
≤ 1.5×, ~1.2× typical); a class holds one padded row block [L, d] per task, so the per-step work is a
gather plus one batched matmul `einsum('nld,nle->nde')` per class, whose output is already one d×d
matrix per task (no scatter-add). This replaces a per-observation outer-product `segment_sum`, which
writes nnz·d² floats and runs at a few % of the matmul peak. Weights must be ≥ 0: A = (√w·X)ᵀ(√w·X).

Tasks are dealt to `n_shards` shards round-robin in order of decreasing count (skewed popularity
still balances). Every array of the plan has a leading shard axis, so `shard_map` over a device mesh
gives each device its own tasks while the feature table is replicated; with one shard the same code
runs unsharded. `global_task[p, l]` names the task in local slot l of shard p (n_tasks = padding) and
`flat_index[i]` finds task i in a stacked [P·block] output. Every task, also one without observations,
has a row in some class (`LengthClass.task`), so a private release covers every task; solvers work on the
class outputs stacked in class order (`class_tasks` names each row's task) and reorder only the solutions.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jdp import noise

ROWS_PER_BATCH = 65536  # gathered rows per scan iteration: bounds memory at ROWS_PER_BATCH·d floats


def length_classes(max_count: int, fine: bool = True, smallest: int = 4) -> np.ndarray:
    """Class lengths up to ≥ max_count: 4, 6, 8, 12, 16, 24, ... (≈√2 growth, ≤ 1.5× padding) when
    `fine`, else powers of two (fewer classes, so less to compile, for small data)."""
    sizes = [smallest]
    while sizes[-1] < max_count:
        if fine:
            nxt = sizes[-1] * 3 // 2 if len(sizes) % 2 else sizes[-1] * 4 // 3
        else:
            nxt = sizes[-1] * 2
        sizes.append(max(nxt, sizes[-1] + 1))
    return np.asarray(sizes, np.int64)


FINE_CLASSES_MIN_NNZ = 200_000  # below this, compile time outweighs padding: use power-of-two classes


@dataclasses.dataclass(frozen=True)
class LengthClass:
    src: np.ndarray      # int32 [P, n, L] feature-table row per slot (padding: 0)
    sqrt_w: np.ndarray   # float32 [P, n, L] √weight per slot (padding: 0)
    obs: np.ndarray      # int64 [P, n, L] observation index per slot (−1 padding)
    task: np.ndarray     # int32 [P, n] global task of each row (n_tasks: padding row)


@dataclasses.dataclass(frozen=True)
class GramPlan:
    n_tasks: int
    n_shards: int
    block: int                   # tasks per shard
    global_task: np.ndarray      # int32 [P, block] task in each local slot (n_tasks = padding)
    flat_index: np.ndarray       # int32 [n_tasks] position of each task in the stacked [P·block] output
    stack_index: np.ndarray      # int32 [P, block] row of each local slot in the shard's stacked class outputs
    classes: tuple[LengthClass, ...]

    @property
    def padded_rows(self) -> int:
        return int(sum(c.src.size for c in self.classes))

    def slot_values(self, values: np.ndarray) -> tuple[np.ndarray, ...]:
        """Lays a per-observation array [nnz] out like the plan (0 in padding)."""
        values = np.asarray(values, np.float32)
        return tuple(np.where(c.obs >= 0, values[np.maximum(c.obs, 0)], 0.0).astype(np.float32)
                     for c in self.classes)


def build_plan(task: np.ndarray, src: np.ndarray, weight: np.ndarray | None, n_tasks: int,
               n_shards: int = 1) -> GramPlan:
    """Host-side layout of observations (task id [nnz], feature row [nnz], weight ≥ 0 [nnz])."""
    task = np.asarray(task, np.int64)
    src = np.asarray(src, np.int64)
    nnz = task.shape[0]
    if task.ndim != 1 or src.shape != (nnz,):
        raise ValueError(f"task and src must be 1-d of equal length, got {task.shape} and {src.shape}")
    if nnz and (task.min() < 0 or task.max() >= n_tasks):
        raise ValueError(f"task ids must lie in [0, {n_tasks})")
    weight = np.ones(nnz, np.float32) if weight is None else np.asarray(weight, np.float32)
    if weight.shape != (nnz,) or not np.all(np.isfinite(weight)) or np.any(weight < 0):
        raise ValueError("weight must be finite, >= 0 and one per observation")
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    obs = np.flatnonzero(weight > 0)  # zero-weight observations contribute nothing
    order = obs[np.lexsort((src[obs], task[obs]))]  # by task, then feature row (cache-friendlier gather)
    counts = np.bincount(task[order], minlength=n_tasks)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

    block = -(-n_tasks // n_shards)
    rank = np.empty(n_tasks, np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(n_tasks)
    shard_of, local_of = rank % n_shards, rank // n_shards
    global_task = np.full((n_shards, block), n_tasks, np.int32)
    global_task[shard_of, local_of] = np.arange(n_tasks)
    flat_index = (shard_of * block + local_of).astype(np.int32)

    sizes = length_classes(max(int(counts.max(initial=0)), 1), fine=len(order) >= FINE_CLASSES_MIN_NNZ)
    cls_of = np.searchsorted(sizes, counts)  # tasks without observations go to the first class (all padding)
    classes, offset = [], 0
    stack_index = np.full((n_shards, block), -1, np.int64)
    for c, length in enumerate(sizes):
        tasks_c = np.flatnonzero(cls_of == c)
        if tasks_c.size == 0:
            continue
        per_shard = np.bincount(shard_of[tasks_c], minlength=n_shards)
        batch = max(1, ROWS_PER_BATCH // int(length))
        n = int(per_shard.max())
        n = -(-n // batch) * batch if n > batch else n  # whole scan batches, or one short batch
        slots = np.full((n_shards, n, length), -1, np.int64)
        row_task = np.full((n_shards, n), n_tasks, np.int32)
        offs = np.arange(length)
        for p in range(n_shards):  # loop over shards (a handful), never over tasks
            mine = tasks_c[shard_of[tasks_c] == p]
            pos = starts[mine][:, None] + offs[None, :]
            valid = offs[None, :] < counts[mine][:, None]
            if len(order):
                slots[p, : mine.size] = np.where(valid, order[np.minimum(pos, len(order) - 1)], -1)
            stack_index[p, local_of[mine]] = offset + np.arange(mine.size)
            row_task[p, : mine.size] = mine
        ok = slots >= 0
        src_slots = np.where(ok, src[np.maximum(slots, 0)], 0).astype(np.int32)
        sw = np.where(ok, np.sqrt(weight[np.maximum(slots, 0)]), 0.0).astype(np.float32)
        classes.append(LengthClass(src_slots, sw, slots, row_task))
        offset += n
    stack_index[stack_index < 0] = offset  # padding slots (no task) read an all-zero row
    return GramPlan(n_tasks, n_shards, block, global_task, flat_index, stack_index.astype(np.int32),
                    tuple(classes))


def device_arrays(plan: GramPlan, labels: tuple[np.ndarray, ...] | None = None):
    """The plan's per-step inputs as jax arrays: ((src, sqrt_w, label) per class, stack_index)."""
    if labels is None:
        labels = tuple(np.zeros(c.src.shape, np.float32) for c in plan.classes)
    # device_put, not jnp.asarray: the latter compiles a staging kernel per new shape (~6 ms each, one
    # per length class and array: ~1 s of a small fit's first run)
    classes = tuple(jax.device_put((c.src, c.sqrt_w, l)) for c, l in zip(plan.classes, labels))
    return classes, jax.device_put(plan.stack_index)


def class_tasks(plan: GramPlan) -> tuple[jax.Array, ...]:
    """Per class, the global task of each row [P, n] (n_tasks for padding rows), on device."""
    return tuple(jax.device_put(c.task) for c in plan.classes)


def class_gram(feats, src, sqrt_w, label):
    """One length class of one shard: src/sqrt_w/label [n, L] -> A [n, d, d], b [n, d]. The products sum bounded
    per-user contributions, so they run at `noise.SUM_PRECISION` (TF32 would round them past the bound)."""
    n, length = src.shape
    batch = min(n, max(1, ROWS_PER_BATCH // length))

    def step(_, xs):
        s, w, y = xs
        x = feats[s] * w[..., None]                    # √w·x   [batch, L, d]
        with noise.exact_matmuls():
            return None, (jnp.einsum("nld,nle->nde", x, x), jnp.einsum("nld,nl->nd", x, w * y))

    xs = tuple(v.reshape(n // batch, batch, length) for v in (src, sqrt_w, label))
    _, (a, b) = jax.lax.scan(step, None, xs)
    return a.reshape(n, *a.shape[2:]), b.reshape(n, -1)


def shard_gram(feats: jax.Array, classes, stack_index: jax.Array):
    """A [block, d, d], b [block, d] for ONE shard (class arrays and stack_index without shard axis)."""
    d = feats.shape[1]
    outs = [class_gram(feats, s, w, y) for s, w, y in classes]
    a = jnp.concatenate([o[0] for o in outs] + [jnp.zeros((1, d, d), feats.dtype)])
    b = jnp.concatenate([o[1] for o in outs] + [jnp.zeros((1, d), feats.dtype)])
    return a[stack_index], b[stack_index]


@jax.jit
def gram_unsharded(feats, classes, stack_index):
    """A [P·block, d, d], b [P·block, d] on one device, shards computed one after another; index
    rows with `plan.flat_index` for task order."""
    outs = [shard_gram(feats, tuple((s[p], w[p], y[p]) for s, w, y in classes), stack_index[p])
            for p in range(stack_index.shape[0])]
    return jnp.concatenate([o[0] for o in outs]), jnp.concatenate([o[1] for o in outs])


@functools.partial(jax.jit, static_argnames=("n_tasks", "chunk"))
def segment_sum_gram(feats: jax.Array, task: jax.Array, src: jax.Array, weight: jax.Array, label: jax.Array,
                     n_tasks: int, chunk: int = 65536):
    """Plain baseline: per-observation outer products accumulated with segment_sum, in chunks of
    observations to bound memory. Reference for tests and benchmarks only."""
    nnz = task.shape[0]
    pad = (-nnz) % chunk
    task = jnp.pad(task, (0, pad), constant_values=n_tasks)
    src, weight, label = jnp.pad(src, (0, pad)), jnp.pad(weight, (0, pad)), jnp.pad(label, (0, pad))
    d = feats.shape[1]

    def step(carry, xs):
        a_acc, b_acc = carry
        t, s, w, y = xs
        x = feats[s]
        outer = w[:, None, None] * x[:, :, None] * x[:, None, :]
        a_acc = a_acc + jax.ops.segment_sum(outer, t, num_segments=n_tasks + 1)
        b_acc = b_acc + jax.ops.segment_sum((w * y)[:, None] * x, t, num_segments=n_tasks + 1)
        return (a_acc, b_acc), None

    init = (jnp.zeros((n_tasks + 1, d, d), feats.dtype), jnp.zeros((n_tasks + 1, d), feats.dtype))
    xs = tuple(v.reshape(-1, chunk) for v in (task, src, weight, label))
    (a, b), _ = jax.lax.scan(step, init, xs)
    return a[:n_tasks], b[:n_tasks]


def observation_index(plan: GramPlan) -> tuple[jax.Array, ...]:
    """Per class, the observation index of each slot [P, n, L] (−1 in padding), on device: with it the
    labels can change every step without rebuilding the plan (`with_labels`)."""
    return tuple(jax.device_put(np.asarray(c.obs, np.int32)) for c in plan.classes)


@jax.jit  # one program for all classes (eagerly, every class's gather/where compiles on its own)
def with_labels(classes, obs_index: tuple[jax.Array, ...], values: jax.Array):
    """`classes` (from `device_arrays`) with their label slots set to values[obs] (0 in padding)."""
    return tuple((src, sqrt_w, jnp.where(obs >= 0, values[jnp.maximum(obs, 0)], 0.0).astype(jnp.float32))
                 for (src, sqrt_w, _), obs in zip(classes, obs_index))
