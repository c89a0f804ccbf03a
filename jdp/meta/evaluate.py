"""Transfer risk: fine-tune each new task from the meta-model(s) and measure its test loss.

For each new task the base learner is run from every meta-model on the task's fine-tuning examples,
the model with the smallest regularised fine-tuning loss is chosen (the paper's C(Z)), and the risk of
the fine-tuned parameters on the task's held-out examples is returned. Evaluation uses fresh tasks, not
the private training tasks, so it spends no privacy budget.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jdp.meta import engine
from jdp.meta.meta_nsgd import MetaResult
from jdp.meta.tasks import TaskSet


def per_task_risk(key, learner, spec: engine.FlatSpec, models: jax.Array, finetune: TaskSet,
                  test: TaskSet) -> jax.Array:
    """Test risk per new task [K] after fine-tuning from the best of the q models [q, D]."""
    def one(data, mask, tdata, tmask, k):
        def fit_one(hq, kk):
            hp = spec.unravel(hq)
            w = learner.fit(hp, data, mask, kk)
            return learner.objective(w, hp, data, mask), learner.risk(w, tdata, tmask)

        obj, risk = jax.vmap(fit_one)(models, jax.random.split(k, models.shape[0]))
        return risk[jnp.argmin(obj)]

    keys = jax.random.split(key, finetune.n_tasks)
    return jax.vmap(one)(finetune.data, finetune.mask, test.data, test.mask, keys)


per_task_risk_jit = jax.jit(per_task_risk, static_argnames=("learner", "spec"))


def transfer_risk(key, learner, result_or_models, finetune: TaskSet, test: TaskSet,
                  spec: engine.FlatSpec | None = None) -> float:
    """Mean test risk over new tasks; `result_or_models` is a MetaResult or flat models [q, D] (+ spec)."""
    if isinstance(result_or_models, MetaResult):
        models, spec = result_or_models.flat, result_or_models.spec
    else:
        models = jnp.atleast_2d(jnp.asarray(result_or_models, jnp.float32))
        if spec is None:
            spec = engine.FlatSpec.of(models[0])
    if finetune.n_tasks != test.n_tasks:
        raise ValueError(f"finetune and test must hold the same tasks, got {finetune.n_tasks} and {test.n_tasks}")
    return float(jnp.mean(per_task_risk_jit(key, learner, spec, models, finetune, test)))
