"""Private clustering-based meta-learning (Zhou & Bassily 2022, Alg. 2): q meta-models.

Privacy unit: one task's whole dataset (task-level DP); relation as in meta-NSGD (add/remove one task
for Poisson sampling, replace one task for fixed-size sampling).

Each sampled task fits its base learner from every meta-model h_i, picks C(Z) = argmin_i R_Z,λ(ŵ_i; h_i),
and sends its clipped meta-gradient to that model only; every model gets its own independent noise.
The concatenated update (h_1..h_q) therefore has the same L2 sensitivity as one model (C under
add/remove, 2C under replace-one), so the noise calibrated for meta-NSGD serves any q
(`update_sensitivity` computes it on concrete neighbouring batches for tests).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jdp.meta import engine
from jdp.meta.meta_nsgd import MetaResult, run_private, stack_init
from jdp.meta.tasks import TaskSet
from jdp.validation import check_positive, renamed_keywords

PyTree = Any


def random_init(key, template: PyTree, q: int, scale: float) -> list[PyTree]:
    """q meta-models drawn uniformly in [-scale, scale] (data-independent, public randomness)."""
    if int(q) < 1:
        raise ValueError(f"q must be >= 1, got {q}")
    check_positive(scale, "scale", allow_zero=True)
    spec = engine.FlatSpec.of(template)
    flat = jax.random.uniform(key, (int(q), spec.size), minval=-scale, maxval=scale)
    return [spec.unravel(f) for f in flat]


@renamed_keywords(clip="l2_clip")  # the old name works until the next release, with a DeprecationWarning
def private_clustering_meta(key, tasks: TaskSet, learner, q: int, *, epsilon: float | None, delta: float,
                            steps: int, batch_size: int, meta_lr: float, l2_clip: float, h0: list | None = None,
                            template: PyTree | None = None, init_scale: float = 0.18,
                            sampling: str = "poisson", output: str = "last", calibration: str = "accountant",
                            radius: float | None = None, noise_multiplier: float | None = None) -> MetaResult:
    """(ε, δ) task-level DP clustering meta-learning with q meta-models (Alg. 2).

    h0: list of q initial parameter pytrees, or None to draw them uniformly in [-init_scale, init_scale]
    shaped like `template` (default init_scale ≈ 1/√30, PyTorch's Linear(30, 1) init as in the authors'
    code). Output: the last iterate (the paper) or "average".
    """
    if int(q) < 1:
        raise ValueError(f"q must be >= 1, got {q}")
    k_init, k_run = jax.random.split(key)
    if h0 is None:
        if template is None:
            raise ValueError("give h0 (q initial models) or template (a parameter pytree to shape them)")
        h0 = random_init(k_init, template, q, init_scale)
    h0_flat, spec = stack_init(list(h0), q)
    return run_private(k_run, tasks, learner, h0_flat, spec, name=f"clustering meta-learning (q={q})",
                       epsilon=epsilon, delta=delta, steps=steps, batch_size=batch_size, meta_lr=meta_lr,
                       l2_clip=l2_clip, sampling=sampling, output=output, calibration=calibration, radius=radius,
                       noise_multiplier=noise_multiplier)


@renamed_keywords(clip="l2_clip")
def routed_update(learner, spec: engine.FlatSpec, h: jax.Array, tasks: TaskSet, key, l2_clip: float) -> jax.Array:
    """The pre-noise update Σ_tasks onehot(C(Z)) ⊗ clip(ĝ_Z) [q, D] for a batch of tasks (task i uses
    key i, so two batches differing in one task differ only in that task's contribution)."""
    keys = jax.random.split(key, tasks.n_tasks)
    return _routed_jit(learner, spec, h, tasks.data, tasks.mask, keys, jnp.ones((tasks.n_tasks,)), jnp.float32(l2_clip))


_routed_jit = jax.jit(engine.routed_sum, static_argnames=("learner", "spec"))


@functools.partial(jax.jit, static_argnames=("learner", "spec"))
def _drop_one_sensitivity(learner, spec, h, data, mask, keys, l2_clip):
    k = mask.shape[0]
    full = engine.routed_sum(learner, spec, h, data, mask, keys, jnp.ones((k,)), l2_clip)
    keep = jnp.array([[j for j in range(k) if j != i] for i in range(k)])  # [K, K-1]

    def without(idx):
        d = jax.tree.map(lambda a: a[idx], data)
        return engine.routed_sum(learner, spec, h, d, mask[idx], keys[idx], jnp.ones((k - 1,)), l2_clip)

    parts = jax.vmap(without)(keep)
    return jnp.sqrt(jnp.sum((full[None] - parts) ** 2, axis=(1, 2)))


@renamed_keywords(clip="l2_clip")
def update_sensitivity(learner, spec: engine.FlatSpec, h: jax.Array, tasks: TaskSet, key,
                       l2_clip: float) -> jax.Array:
    """[K]: ‖U(batch) − U(batch without task i)‖ of the concatenated q-model update, recomputed on
    each reduced batch (add/remove one task); every entry is <= l2_clip for any q."""
    keys = jax.random.split(key, tasks.n_tasks)
    return _drop_one_sensitivity(learner, spec, h, tasks.data, tasks.mask, keys, jnp.float32(l2_clip))
