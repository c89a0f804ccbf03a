"""Shared vectorised engine of noisy meta-SGD with q meta-models (Alg. 1 is q = 1, Alg. 2 is q >= 1).

One step: sample a batch of tasks (Poisson or fixed size without replacement); every sampled task fits
the base learner from each of the q meta-models (vmap over tasks × models), picks the model with the
smallest regularised loss, and sends its clipped meta-gradient λ(h − ŵ) to that model only; the server
adds independent Gaussian noise to every model's sum and takes a step. Because each task's gradient goes
to exactly one model, the concatenated q-model sum has the same L2 sensitivity C as a single model
(add/remove one task), so the noise does not depend on q (`clustering.update_sensitivity` checks it).

Meta-models live as flat float32 vectors [q, D]; `FlatSpec` maps them to the learner's parameter
pytree. Everything inside `train` is jit-compiled; steps and the number of active tasks are dynamic so
one compilation serves a whole grid of experiments (vmap over configurations).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp import noise
from jdp.sampling import poisson_keep

PyTree = Any


@dataclasses.dataclass(frozen=True)
class FlatSpec:
    """Hashable description of a parameter pytree <-> flat vector [D] mapping."""
    treedef: Any
    shapes: tuple

    @staticmethod
    def of(tree: PyTree) -> "FlatSpec":
        leaves, treedef = jax.tree.flatten(tree)
        return FlatSpec(treedef, tuple(tuple(np.shape(x)) for x in leaves))

    @property
    def size(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes))

    def ravel(self, tree: PyTree) -> jax.Array:
        return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])

    def unravel(self, flat: jax.Array) -> PyTree:
        out, i = [], 0
        for s in self.shapes:
            k = math.prod(s)
            out.append(flat[i:i + k].reshape(s))
            i += k
        return jax.tree.unflatten(self.treedef, out)


def select_and_grad(learner, spec: FlatSpec, h: jax.Array, data: PyTree, mask: jax.Array, key: jax.Array,
                    l2_clip: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One task against q meta-models h [q, D] -> (chosen model index, clipped meta-gradient [D])."""
    def fit_one(hq, k):
        hp = spec.unravel(hq)
        w = learner.fit(hp, data, mask, k)
        return spec.ravel(w), learner.objective(w, hp, data, mask)

    w, obj = jax.vmap(fit_one)(h, jax.random.split(key, h.shape[0]))
    a = jnp.argmin(obj)
    g = learner.lam * (h[a] - w[a])
    # a task whose meta-gradient is not finite (finite data can overflow in the learner) contributes 0: as NaN it
    # would make the released sum NaN and reveal the task; l2_clip = inf: finite gradients unchanged
    return a, noise.clip_contribution(g, l2_clip)


def routed_sum(learner, spec, h, data, mask, keys, weights, l2_clip) -> jax.Array:
    """Σ_tasks weight · onehot(chosen model) ⊗ clipped gradient -> [q, D] (data leaves [b, n, ...]). Traced at
    `noise.SUM_PRECISION`: the sum is a matmul, which TF32 would round past the clip."""
    with noise.exact_matmuls():
        a, g = jax.vmap(select_and_grad, in_axes=(None, None, None, 0, 0, 0, None))(
            learner, spec, h, data, mask, keys, l2_clip)
        onehot = jax.nn.one_hot(a, h.shape[0], dtype=g.dtype) * weights[:, None]
        return onehot.T @ g


def _gather(data, mask, idx):
    return jax.tree.map(lambda x: x[idx], data), mask[idx]


def _fixed_batch(key, n_tasks_total, n_active, m):
    """m distinct tasks uniformly from the first n_active (top-m of masked uniforms)."""
    u = jax.random.uniform(key, (n_tasks_total,))
    u = jnp.where(jnp.arange(n_tasks_total) < n_active, u, 2.0)
    return jax.lax.top_k(-u, m)[1]


def train(key, data: PyTree, mask: jax.Array, h0: jax.Array, *, learner, spec: FlatSpec, batch_size: int,
          sampling: str, steps, n_active, meta_lr, l2_clip, noise_std, radius, mean_over: str = "expected",
          chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Runs `steps` noisy meta-SGD steps; returns (last iterate [q, D], average of iterates 1..T [q, D]).

    data leaves [K, n, ...], mask [K, n]; h0 [q, D]. noise_std: std of the Gaussian noise added to each
    model's *sum* of clipped gradients (0 = none); the sum is divided by the expected batch size
    (`mean_over="expected"`, required for DP: the realised Poisson batch size is private) or by the
    realised one ("realised", non-private runs). radius: projection onto the L2 ball (inf = none).
    """
    k_total = mask.shape[0]
    m = int(batch_size)
    cap = int(chunk or m)
    q, d = h0.shape
    rate = m / n_active

    def step_sum(h, k):
        ks, kf = jax.random.split(k)
        if sampling == "fixed":
            idx = _fixed_batch(ks, k_total, n_active, m)
            dat, msk = _gather(data, mask, idx)
            s = routed_sum(learner, spec, h, dat, msk, jax.random.split(kf, m), jnp.ones((m,)), l2_clip)
            return s, jnp.float32(m)
        # Poisson: every active task joins independently w.p. m/K; process the realised batch in chunks
        # of `cap` tasks (a while loop) so the sample is exact and the shapes static.
        inc = poisson_keep(ks, k_total, rate) & (jnp.arange(k_total) < n_active)  # jdp's one Poisson sampler
        count = jnp.sum(inc)
        order = jnp.argsort(jnp.where(inc, 0, 1), stable=True)
        order = jnp.concatenate([order, jnp.zeros((cap,), order.dtype)])  # room for the last chunk

        def body(state):
            c, s = state
            idx = jax.lax.dynamic_slice(order, (c * cap,), (cap,))
            valid = (c * cap + jnp.arange(cap)) < count
            dat, msk = _gather(data, mask, idx)
            keys = jax.random.split(jax.random.fold_in(kf, c), cap)
            return c + 1, s + routed_sum(learner, spec, h, dat, msk, keys, valid.astype(jnp.float32), l2_clip)

        _, s = jax.lax.while_loop(lambda st: st[0] * cap < count, body, (jnp.int32(0), jnp.zeros((q, d))))
        return s, count.astype(jnp.float32)

    def body(t, carry):
        h, h_sum = carry
        k = jax.random.fold_in(key, t)
        k_step, k_noise = jax.random.split(k)
        s, count = step_sum(h, k_step)
        denom = jnp.float32(m) if mean_over == "expected" else jnp.maximum(count, 1.0)
        noisy = noise.add_gaussian(k_noise, s, noise_std) / denom
        h = noise.clip_by_norm(h - meta_lr * noisy, radius)  # projection onto the ball of radius `radius`
        return h, h_sum + h

    h, h_sum = jax.lax.fori_loop(0, steps, body, (h0, jnp.zeros_like(h0)))
    return h, h_sum / jnp.maximum(steps, 1)


train_jit = jax.jit(train, static_argnames=("learner", "spec", "batch_size", "sampling", "mean_over", "chunk"))
