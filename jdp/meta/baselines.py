"""Baselines: local training and NON-PRIVATE meta-learning (references, never defaults).

- `local_training_risk`: each new task fits alone with the same base learner from a fixed public
  prior h0 (default zero), no meta-model; uses no training tasks, so no privacy cost.
- `meta_sgd_nonprivate`: meta-SGD / clustering meta-learning with no clipping and no noise
  (ε = ∞). NOT differentially private; its report holds a NonPrivateDpEvent.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jdp.meta import engine, privacy
from jdp.meta.clustering import random_init
from jdp.meta.evaluate import transfer_risk
from jdp.meta.meta_nsgd import MetaResult, _validate, check_fits, stack_init
from jdp.meta.tasks import TaskSet
from jdp.validation import renamed_keywords

PyTree = Any


def local_training_risk(key, learner, template: PyTree, finetune: TaskSet, test: TaskSet,
                        h0: PyTree | None = None) -> float:
    """Transfer risk of local training: fine-tune each new task from h0 (default: zeros like template)."""
    spec = engine.FlatSpec.of(template)
    flat = jnp.zeros((1, spec.size)) if h0 is None else spec.ravel(h0)[None]
    return transfer_risk(key, learner, flat, finetune, test, spec=spec)


@renamed_keywords(clip="l2_clip")  # the old name works until the next release, with a DeprecationWarning
def meta_sgd_nonprivate(key, tasks: TaskSet, learner, *, steps: int, batch_size: int, meta_lr: float,
                        q: int = 1, h0: PyTree | list | None = None, template: PyTree | None = None,
                        init_scale: float = 0.18, sampling: str = "fixed", output: str = "last",
                        l2_clip: float | None = None, radius: float | None = None) -> MetaResult:
    """NON-PRIVATE meta-SGD (q = 1) or clustering meta-learning (q > 1): no noise, optional clipping.

    Mirrors the private algorithms exactly except for the noise, for ε = ∞ reference curves.
    """
    _validate(tasks, steps, batch_size, meta_lr, l2_clip, sampling, output, radius)
    k_init, k_run = jax.random.split(key)
    if h0 is None:
        if template is None:
            raise ValueError("give h0 or template")
        h0 = random_init(k_init, template, q, init_scale)
        h0_flat, spec = stack_init(h0, q)
    elif q == 1 and not isinstance(h0, list):
        h0_flat, spec = stack_init(h0)
    else:
        h0_flat, spec = stack_init(list(h0), q)
    check_fits(learner, spec, h0_flat, tasks)
    last, avg = engine.train_jit(
        k_run, tasks.data, tasks.mask, h0_flat, learner=learner, spec=spec, batch_size=int(batch_size),
        sampling=sampling, steps=int(steps), n_active=tasks.n_tasks, meta_lr=float(meta_lr),
        l2_clip=jnp.float32(math.inf if l2_clip is None else l2_clip), noise_std=jnp.float32(0.0),
        radius=jnp.float32(math.inf if radius is None else radius))
    return MetaResult(avg if output == "average" else last, last, avg, spec, privacy.nonprivate_report(),
                      None, 0.0, int(batch_size), int(steps))
