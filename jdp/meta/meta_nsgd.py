"""meta-NSGD (Zhou & Bassily 2022, Alg. 1): private meta-learning of a regularisation bias h.

Privacy unit: one task's whole dataset (task-level DP). Neighbouring relation: add/remove one task
for Poisson task sampling, replace one task for fixed-size sampling without replacement (the event each
sampling needs in dp_accounting; see `jdp.meta.privacy`).

Each of T steps samples tasks (expected batch m), each sampled task solves its base-learner problem
from h and returns the meta-gradient λ(h − ŵ_h(Z)) clipped to C (the paper's 2L + b), and the server
updates h ← Proj_W(h − η (Σ ĝ / m + N(0, σ²I))). Output: the average of the iterates (the paper) or
the last iterate. Noise calibration: `"accountant"` (smallest noise multiplier meeting (ε, δ) under the
dp_accounting event of the sampling actually used) or `"theory"` (the paper's closed form for σ and m;
the report still states the accountant's ε for what was run).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jdp import accounting as acc
from jdp.meta import engine, privacy
from jdp.meta.tasks import TaskSet
from jdp.validation import check_positive, check_privacy, renamed_keywords

PyTree = Any
OUTPUTS = ("average", "last")
CALIBRATIONS = ("accountant", "theory")


@dataclasses.dataclass(frozen=True)
class MetaResult:
    """Output of a meta-learning run. `flat` [q, D]: the chosen output (average or last iterate) of
    the q meta-models as flat vectors; `spec` maps a row back to the learner's parameter pytree."""
    flat: jax.Array
    flat_last: jax.Array
    flat_average: jax.Array
    spec: engine.FlatSpec
    report: acc.PrivacyReport
    noise_multiplier: float | None  # noise std / sensitivity under the report's relation (None: non-private)
    noise_std: float  # std of the noise added to each model's sum of clipped gradients
    batch_size: int
    steps: int

    @property
    def q(self) -> int:
        return int(self.flat.shape[0])

    def params(self, i: int = 0) -> PyTree:
        """Meta-model i as the learner's parameter pytree."""
        if not 0 <= i < self.q:
            raise ValueError(f"i must be in [0, {self.q}), got {i}")
        return self.spec.unravel(self.flat[i])


def _validate(tasks: TaskSet, steps: int, batch_size: int, meta_lr: float, l2_clip: float | None,
              sampling: str, output: str, radius: float | None) -> None:
    if not isinstance(tasks, TaskSet):
        raise ValueError(f"tasks must be a TaskSet, got {type(tasks).__name__}")
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 1 <= int(batch_size) <= tasks.n_tasks:
        raise ValueError(f"batch_size must be in [1, n_tasks={tasks.n_tasks}], got {batch_size}")
    check_positive(meta_lr, "meta_lr")
    if l2_clip is not None:
        check_positive(l2_clip, "l2_clip")
    privacy.check_sampling(sampling)
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    if radius is not None:
        check_positive(radius, "radius")


def stack_init(h0: PyTree, q: int | None = None) -> tuple[jax.Array, engine.FlatSpec]:
    """h0: one parameter pytree (q = 1) or a list of q pytrees -> ([q, D] float32, spec)."""
    models = list(h0) if isinstance(h0, (list, tuple)) and q is not None else [h0]
    spec = engine.FlatSpec.of(models[0])
    flat = jnp.stack([spec.ravel(m) for m in models])
    if not bool(jnp.all(jnp.isfinite(flat))):
        raise ValueError("h0 contains NaN or inf")
    if q is not None and flat.shape[0] != q:
        raise ValueError(f"h0 must hold q={q} models, got {flat.shape[0]}")
    return flat, spec


def check_fits(learner, spec: engine.FlatSpec, h0_flat: jax.Array, tasks: TaskSet) -> None:
    """Raises ValueError when the meta-model h0 does not fit the learner on these tasks: one meta-gradient
    is traced abstractly (no compute), before any noise is calibrated."""
    one = jax.tree.map(lambda a: a[0], tasks.data)
    try:
        _, g = jax.eval_shape(lambda h, d, m: engine.select_and_grad(learner, spec, h, d, m, jax.random.key(0),
                                                                     jnp.float32(1.0)), h0_flat, one, tasks.mask[0])
    except (TypeError, ValueError) as err:
        shapes = [tuple(x.shape) for x in jax.tree.leaves(spec.unravel(h0_flat[0]))]
        data = [tuple(x.shape[1:]) for x in jax.tree.leaves(tasks.data)]
        raise ValueError(f"h0 (parameter shapes {shapes}) does not fit the learner on these tasks (per-task data "
                         f"shapes {data}): {str(err).splitlines()[0]}") from None
    if g.shape != h0_flat.shape[1:]:
        raise ValueError(f"the learner's meta-gradient has shape {g.shape}, h0 has {h0_flat.shape[1:]}")


def run_private(key, tasks: TaskSet, learner, h0_flat: jax.Array, spec: engine.FlatSpec, *, name: str,
                epsilon: float | None, delta: float, steps: int, batch_size: int, meta_lr: float, l2_clip: float,
                sampling: str, output: str, calibration: str, radius: float | None,
                noise_multiplier: float | None) -> MetaResult:
    """Calibrates, runs the engine and fills the report (shared by Alg. 1 and Alg. 2)."""
    _validate(tasks, steps, batch_size, meta_lr, l2_clip, sampling, output, radius)
    check_fits(learner, spec, h0_flat, tasks)
    l2_clip = check_positive(l2_clip, "l2_clip")
    epsilon, delta = check_privacy(epsilon, delta, tasks.n_tasks, unit="task")  # the one rule, before any work
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of epsilon (calibrated noise) or noise_multiplier")
    sens = privacy.sensitivity_factor(privacy.native_relation(sampling)) * l2_clip
    k = tasks.n_tasks
    train_args = dict(learner=learner, spec=spec, sampling=sampling, steps=int(steps), n_active=k,
                      meta_lr=float(meta_lr), l2_clip=jnp.float32(l2_clip),
                      radius=jnp.float32(math.inf if radius is None else radius))
    compiled = None
    if noise_multiplier is None and calibration != "theory":
        # the program does not read σ (an input): traced here, compiled beside the calibration (XLA releases the
        # GIL; the calibration is Python and numpy), and called once both are done
        lowered = engine.train_jit.lower(key, tasks.data, tasks.mask, h0_flat, batch_size=int(batch_size),
                                         noise_std=jax.ShapeDtypeStruct((), jnp.float32), **train_args)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jdp-compile")
        compiled = pool.submit(lowered.compile)
        pool.shutdown(wait=False)
    if noise_multiplier is not None:
        z = check_positive(noise_multiplier, "noise_multiplier")
    elif calibration == "theory":
        sigma, batch_size = privacy.theory_noise(epsilon, delta, k, steps, l2_clip)
        z = sigma * batch_size / sens  # σ is on the mean gradient, the engine adds noise to the sum
    else:
        z = privacy.calibrate_meta_sgd(epsilon, delta, k, int(batch_size), int(steps), sampling)
    noise_std = z * sens
    report = privacy.new_report(delta, sampling)
    report.assume(f"number of tasks K = {k} treated as public (sets the sampling rate m/K)")
    privacy.add_release(report, f"{name}: {steps} noisy steps, {sampling} sampling of {batch_size}/{k} tasks",
                        sampling, noise_std, l2_clip, n_tasks=k, batch_size=int(batch_size), steps=int(steps))
    if compiled is not None:  # the call below then reuses the compiled program
        compiled.result()
    last, avg = engine.train_jit(key, tasks.data, tasks.mask, h0_flat, batch_size=int(batch_size),
                                 noise_std=jnp.float32(noise_std), **train_args)
    return MetaResult(avg if output == "average" else last, last, avg, spec, report, float(z), float(noise_std),
                      int(batch_size), int(steps))


@renamed_keywords(clip="l2_clip")  # the old name works until the next release, with a DeprecationWarning
def meta_nsgd(key, tasks: TaskSet, learner, h0: PyTree, *, epsilon: float | None, delta: float, steps: int,
              batch_size: int, meta_lr: float, l2_clip: float, sampling: str = "poisson", output: str = "average",
              calibration: str = "accountant", radius: float | None = None,
              noise_multiplier: float | None = None) -> MetaResult:
    """(ε, δ) task-level DP meta-NSGD (Alg. 1) from initial bias h0 (parameter pytree).

    Privacy unit: a task; relation: add/remove one task (sampling="poisson") or replace one task
    (sampling="fixed"), recorded in `result.report`. l2_clip = C bounds each task's meta-gradient (theory:
    2L + b). calibration="theory" uses the paper's σ and m (batch_size is then ignored).
    """
    h0_flat, spec = stack_init(h0)
    return run_private(key, tasks, learner, h0_flat, spec, name="meta-NSGD", epsilon=epsilon, delta=delta,
                       steps=steps, batch_size=batch_size, meta_lr=meta_lr, l2_clip=l2_clip, sampling=sampling,
                       output=output, calibration=calibration, radius=radius, noise_multiplier=noise_multiplier)
