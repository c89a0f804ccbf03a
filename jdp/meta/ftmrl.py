"""DP-FTMRL: one-pass private meta-learning by follow-the-regularised-leader with tree aggregation.

Privacy unit: one task's whole dataset (task-level DP). Neighbouring relation: replace one task by a
null task contributing a zero meta-gradient (REPLACE_SPECIAL, DP-FTRL Def. 1.1), the only relation under
which dp_accounting's RDP accountant supports `SingleEpochTreeAggregationDpEvent`.

Tasks arrive in a stream (a uniformly random order of the K tasks, or the given order), `batch_size`
per step, S = ceil(K / batch_size) steps, each task used exactly once. Step t sums the tasks' clipped
meta-gradients g_s = Σ clip(λ(h_s − ŵ_{h_s}(Z)), C) and sets

    h_{t+1} = Proj_W(h_0 − (η / batch_size) (Σ_{s≤t} g_s + n_t)),

the FTRL minimiser of ⟨Σ g + n_t, h⟩ + (batch_size / 2η)‖h − h_0‖². n_t is the tree-aggregation noise
of the prefix [1..t]: a binary tree over the steps whose nodes carry independent N(0, (zC)² I) noise;
the prefix sum uses the popcount(t) dyadic nodes covering [1..t] (Kairouz et al. 2021).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jdp import noise
from jdp.meta import engine, privacy
from jdp.meta.meta_nsgd import OUTPUTS, MetaResult, check_fits, stack_init
from jdp.meta.tasks import TaskSet
from jdp.validation import check_positive, check_privacy, renamed_keywords

PyTree = Any


def tree_depth(n_steps: int) -> int:
    """Number of tree levels needed for prefixes up to n_steps: ceil(log2(n_steps + 1))."""
    return max(1, math.ceil(math.log2(int(n_steps) + 1)))


def tree_prefix_noise(key, t, dim: int, std, depth: int) -> jax.Array:
    """Noise of the prefix sum [1..t] (t >= 1, may be traced): Σ over set bits j of t of node (j, t >> j).

    Node noise is a deterministic function of (key, level, index), so prefixes sharing a dyadic node
    share its noise, as in a tree built once; prefix variance = popcount(t) · std².
    """
    t = jnp.asarray(t, jnp.int32)

    def node(j):
        k = jax.random.fold_in(jax.random.fold_in(key, j), t >> j)
        on = ((t >> j) & 1).astype(jnp.float32)
        return noise.gaussian(k, (dim,), on)

    return std * jnp.sum(jax.vmap(node)(jnp.arange(depth)), axis=0)


@renamed_keywords(clip="l2_clip")  # the old name works until the next release, with a DeprecationWarning
def dp_ftmrl(key, tasks: TaskSet, learner, h0: PyTree, *, epsilon: float | None, delta: float,
             meta_lr: float, l2_clip: float, batch_size: int = 1, output: str = "average", shuffle: bool = True,
             radius: float | None = None, noise_multiplier: float | None = None) -> MetaResult:
    """(ε, δ) task-level DP-FTMRL: one pass over the tasks with tree-aggregated noise (see module doc).

    Each task is used once; noise per tree node has std z·C, z calibrated so that
    SingleEpochTreeAggregationDpEvent(z, S) spends (ε, δ) under REPLACE_SPECIAL.
    """
    if not isinstance(tasks, TaskSet):
        raise ValueError(f"tasks must be a TaskSet, got {type(tasks).__name__}")
    l2_clip = check_positive(l2_clip, "l2_clip")
    meta_lr = check_positive(meta_lr, "meta_lr")
    epsilon, delta = check_privacy(epsilon, delta, tasks.n_tasks, unit="task")  # the one rule, before any work
    if not 1 <= int(batch_size) <= tasks.n_tasks:
        raise ValueError(f"batch_size must be in [1, n_tasks={tasks.n_tasks}], got {batch_size}")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    if radius is not None:
        check_positive(radius, "radius")
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of epsilon (calibrated noise) or noise_multiplier")
    b, k = int(batch_size), tasks.n_tasks
    n_steps = -(-k // b)
    h0_flat, spec = stack_init(h0)
    check_fits(learner, spec, h0_flat, tasks)
    if noise_multiplier is not None:
        z = check_positive(noise_multiplier, "noise_multiplier")
    else:
        z = privacy.calibrate_tree(epsilon, delta, n_steps)
    report = privacy.new_report(delta, "tree")
    report.assume(f"number of tasks K = {k} treated as public (sets the stream of ceil(K/b) steps)")
    privacy.add_release(report, f"DP-FTMRL: tree aggregation over {n_steps} steps of {b} tasks", "tree", z * l2_clip, l2_clip,
                        n_tasks=k, batch_size=b, steps=n_steps)
    last, avg = _ftmrl_jit(key, tasks.data, tasks.mask, h0_flat[0], learner=learner, spec=spec, batch_size=b,
                           shuffle=bool(shuffle), meta_lr=jnp.float32(meta_lr), l2_clip=jnp.float32(l2_clip),
                           node_std=jnp.float32(z * l2_clip),
                           radius=jnp.float32(math.inf if radius is None else radius))
    last, avg = last[None], avg[None]
    return MetaResult(avg if output == "average" else last, last, avg, spec, report, float(z), float(z * l2_clip),
                      b, n_steps)


def _ftmrl(key, data, mask, h0, *, learner, spec, batch_size, shuffle, meta_lr, l2_clip, node_std, radius):
    k_total = mask.shape[0]
    n_steps = -(-k_total // batch_size)
    depth = tree_depth(n_steps)
    k_perm, k_tree, k_fit = jax.random.split(key, 3)
    order = jax.random.permutation(k_perm, k_total) if shuffle else jnp.arange(k_total)
    pad = n_steps * batch_size - k_total
    order = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)]).reshape(n_steps, batch_size)
    valid = (jnp.arange(n_steps * batch_size) < k_total).astype(jnp.float32).reshape(n_steps, batch_size)

    def body(carry, xs):
        h, g_sum, h_sum = carry
        t, idx, w = xs  # t = 1..S
        dat = jax.tree.map(lambda a: a[idx], data)
        keys = jax.random.split(jax.random.fold_in(k_fit, t), batch_size)
        g = engine.routed_sum(learner, spec, h[None], dat, mask[idx], keys, w, l2_clip)[0]
        g_sum = g_sum + g
        noise = tree_prefix_noise(k_tree, t, h.shape[0], node_std, depth)
        h = h0 - (meta_lr / batch_size) * (g_sum + noise)
        h = h * jnp.minimum(1.0, radius / jnp.maximum(jnp.linalg.norm(h), 1e-12))
        return (h, g_sum, h_sum + h), None

    steps = jnp.arange(1, n_steps + 1)
    (h, _, h_sum), _ = jax.lax.scan(body, (h0, jnp.zeros_like(h0), jnp.zeros_like(h0)), (steps, order, valid))
    return h, h_sum / n_steps


_ftmrl_jit = jax.jit(_ftmrl, static_argnames=("learner", "spec", "batch_size", "shuffle"))
