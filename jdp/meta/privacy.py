"""Task-level privacy accounting for the meta-learning algorithms.

Privacy unit: one whole task dataset Z_k (task-level DP, Zhou & Bassily 2022). Each algorithm releases
noisy sums of per-task meta-gradients clipped to L2 norm C; which dp_accounting event describes the run
depends on how tasks are sampled, and each event is only supported under one neighbouring relation:

| sampling                              | event                                   | relation         | L2 sensitivity of the sum |
|---------------------------------------|-----------------------------------------|------------------|---------------------------|
| Poisson, rate m/K                     | PoissonSampledDpEvent(Gaussian)         | add/remove one task | C                      |
| fixed size m without replacement      | SampledWithoutReplacementDpEvent(Gauss.)| replace one task    | 2C (g -> g')           |
| one pass, tree aggregation (DP-FTMRL) | SingleEpochTreeAggregationDpEvent       | replace one task by a null task | C           |

The Gaussian noise multiplier of an event is noise std / sensitivity *under that relation*, so the same
std protects a fixed-size batch only half as well per unit of noise as a Poisson batch. Totals always come
from dp_accounting's RDP accountant built with the matching relation.

Comparable ε: every release also carries its `jdp.accounting.Restatement`s under BOTH common relations, built
from its noise std and clip C, so `report.epsilon_by_relation()` (dp_accounting) puts methods accounted natively
under different relations side by side:

| mechanism | add/remove one task (sensitivity C)            | replace one task (sensitivity 2C)                  |
|-----------|------------------------------------------------|----------------------------------------------------|
| Poisson   | RDP, PoissonSampled(Gaussian(std/C))  (native) | PLD REPLACE_ONE, PoissonSampled(Gaussian(std/C))*  |
| fixed     | not defined: m of K needs K fixed (None)       | RDP REPLACE_ONE, WOR(Gaussian(std/2C))  (native)   |
| tree      | RDP REPLACE_SPECIAL, Tree(std/C)  (native)**   | RDP REPLACE_SPECIAL, Tree(std/2C)                  |

* dp_accounting's PLD REPLACE_ONE pair is the mixture shifted by ±sensitivity, i.e. two outputs 2C apart,
  so its multiplier is std/C. ** DP-FTRL's streaming relation: a removed task leaves a null slot (zero
  meta-gradient) in the public stream of K slots; one slot changes by at most C. Replacing a task by
  another moves its slot by at most 2C, which is the same tree analysis at sensitivity 2C.
"""
from __future__ import annotations

import functools
import math

from dp_accounting import dp_event as dpe

from jdp import accounting as acc
from jdp.validation import check_positive, check_privacy, renamed_keywords

SAMPLINGS = ("poisson", "fixed")
MECHANISMS = ("poisson", "fixed", "tree")


def check_sampling(sampling: str) -> str:
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    return sampling


def native_relation(mechanism: str) -> acc.Relation:
    """The neighbouring relation under which dp_accounting supports the mechanism's event (module doc)."""
    if mechanism == "tree":
        return acc.REPLACE_SPECIAL
    return acc.ADD_OR_REMOVE_ONE if check_sampling(mechanism) == "poisson" else acc.REPLACE_ONE


def sensitivity_factor(relation: acc.Relation | str) -> float:
    """L2 sensitivity of a sum of vectors clipped to norm C, in units of C, under `relation`."""
    return 2.0 if acc.check_relation(relation) is acc.REPLACE_ONE else 1.0


# ----------------------------------------------------------------------------------------------------
# Events of the algorithms (noise_multiplier = noise std / sensitivity under the event's relation).
def meta_sgd_event(noise_multiplier: float, n_tasks: int, batch_size: int, steps: int,
                   sampling: str) -> dpe.DpEvent:
    """T sampled Gaussian steps of meta-NSGD / clustering meta-learning over K = n_tasks tasks."""
    check_sampling(sampling)
    _check_counts(n_tasks, batch_size, steps)
    gauss = dpe.GaussianDpEvent(float(noise_multiplier))
    if sampling == "poisson":
        step = dpe.PoissonSampledDpEvent(batch_size / n_tasks, gauss)
    else:
        step = dpe.SampledWithoutReplacementDpEvent(n_tasks, batch_size, gauss)
    return dpe.SelfComposedDpEvent(step, int(steps))


def tree_event(noise_multiplier: float, n_steps: int) -> dpe.DpEvent:
    """One pass of tree aggregation over n_steps steps; each task contributes to exactly one step."""
    if int(n_steps) < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    return dpe.SingleEpochTreeAggregationDpEvent(float(noise_multiplier), int(n_steps))


def _check_counts(n_tasks: int, batch_size: int, steps: int) -> None:
    if int(n_tasks) < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    if not 1 <= int(batch_size) <= int(n_tasks):
        raise ValueError(f"batch_size must be in [1, n_tasks={n_tasks}], got {batch_size}")
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")


@functools.lru_cache(maxsize=256)
def calibrate_meta_sgd(epsilon: float, delta: float, n_tasks: int, batch_size: int, steps: int,
                       sampling: str) -> float:
    """Noise multiplier of `meta_sgd_event` meeting (ε, δ) under the sampling's relation (cached)."""
    return acc.calibrate(lambda s: meta_sgd_event(s, n_tasks, batch_size, steps, sampling), epsilon, delta,
                         bracket=(0.05, 500.0), tol=1e-4, relation=native_relation(sampling))


@functools.lru_cache(maxsize=256)
def calibrate_tree(epsilon: float, delta: float, n_steps: int) -> float:
    """Noise multiplier of `tree_event` meeting (ε, δ) under REPLACE_SPECIAL (cached)."""
    return acc.calibrate(lambda s: tree_event(s, n_steps), epsilon, delta, bracket=(0.05, 500.0), tol=1e-4,
                         relation=acc.REPLACE_SPECIAL)


def theory_noise(epsilon: float, delta: float, n_tasks: int, steps: int, grad_bound: float) -> tuple[float, int]:
    """Alg. 1's closed-form calibration: (σ, m) with σ² = 8T(2L+b)² log(1/δ)/(K²ε²), m = max(K√(ε/4T), 1).

    σ is the std of the noise added to the *mean* meta-gradient. This is the paper's bound (Bassily et
    al. 2019, Thm 3.1), kept for comparison; jdp still reports the ε that dp_accounting gives for the
    mechanism actually run with this σ.
    """
    epsilon, delta = check_privacy(epsilon, delta, n_tasks, unit="task")
    grad_bound = check_positive(grad_bound, "grad_bound")
    _check_counts(n_tasks, 1, steps)
    sigma = math.sqrt(8.0 * steps * grad_bound ** 2 * math.log(1.0 / delta) / (n_tasks ** 2 * epsilon ** 2))
    m = max(int(round(n_tasks * math.sqrt(epsilon / (4.0 * steps)))), 1)
    return sigma, min(m, n_tasks)


# ----------------------------------------------------------------------------------------------------
# Releases and reports.
@renamed_keywords(clip="l2_clip")  # the old name works until the next release, with a DeprecationWarning
def restatements(mechanism: str, noise_std: float, l2_clip: float, *, n_tasks: int = 1, batch_size: int = 1,
                 steps: int = 1) -> tuple[acc.Restatement, ...]:
    """The mechanism's event under add/remove one task and under replace one task, where defined (table in
    the module doc). noise_std and l2_clip are those of the run; each multiplier is std / sensitivity in
    dp_accounting's convention for the relation it is accounted under."""
    z = noise_std / l2_clip
    if mechanism == "poisson":
        event = meta_sgd_event(z, n_tasks, batch_size, steps, "poisson")
        return (acc.Restatement(acc.ADD_OR_REMOVE_ONE, event),
                acc.Restatement(acc.REPLACE_ONE, event, "pld"))  # RDP has no replace-one bound for it
    if mechanism == "fixed":  # add/remove is not defined: m of K needs K fixed
        return (acc.Restatement(acc.REPLACE_ONE, meta_sgd_event(z / 2, n_tasks, batch_size, steps, "fixed")),)
    if mechanism == "tree":  # dp_accounting analyses the tree under REPLACE_SPECIAL only
        return (acc.Restatement(acc.ADD_OR_REMOVE_ONE, tree_event(z, steps), accounted_under=acc.REPLACE_SPECIAL),
                acc.Restatement(acc.REPLACE_ONE, tree_event(z / 2, steps), accounted_under=acc.REPLACE_SPECIAL))
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")


def new_report(delta: float, mechanism: str) -> acc.PrivacyReport:
    """An empty task-level report under the mechanism's native relation."""
    return acc.PrivacyReport(delta, unit="task", relation=native_relation(mechanism))


@renamed_keywords(clip="l2_clip")
def add_release(report: acc.PrivacyReport, name: str, mechanism: str, noise_std: float, l2_clip: float, *,
                n_tasks: int, batch_size: int, steps: int) -> acc.PrivacyReport:
    """Records one meta-training release from its noise std and clip C (`l2_clip`): native event and
    sensitivity, plus its restatements under add/remove and replace-one."""
    noise_std, l2_clip = check_positive(noise_std, "noise_std"), check_positive(l2_clip, "l2_clip")
    counts = dict(n_tasks=int(n_tasks), batch_size=int(batch_size), steps=int(steps))
    relation = native_relation(mechanism)
    sens = sensitivity_factor(relation) * l2_clip
    event = (tree_event(noise_std / sens, steps) if mechanism == "tree"
             else meta_sgd_event(noise_std / sens, n_tasks, batch_size, steps, mechanism))
    return report.add(name, event, sens, noise_std, relation=relation,
                      restated=restatements(mechanism, noise_std, l2_clip, **counts))


@renamed_keywords(clip="l2_clip")
@functools.lru_cache(maxsize=256)  # a PLD over many steps takes seconds; tables ask more than once
def epsilon_under(mechanism: str, relation: acc.Relation | str, noise_std: float, l2_clip: float, delta: float, *,
                  n_tasks: int = 1, batch_size: int = 1, steps: int = 1) -> float | None:
    """ε at δ of one run of `mechanism` under `relation` (None when not defined; module doc)."""
    report = add_release(new_report(delta, mechanism), mechanism, mechanism, noise_std, l2_clip, n_tasks=n_tasks,
                         batch_size=batch_size, steps=steps)
    return report.epsilon_by_relation((relation,))[acc.check_relation(relation)]


def nonprivate_report(delta: float = 1e-5) -> acc.PrivacyReport:
    """Report of a non-private reference run: one NonPrivateDpEvent, ε = ∞ under every relation."""
    return acc.PrivacyReport(delta, unit="task").add("non-private meta-training (NOT differentially private)",
                                                     dpe.NonPrivateDpEvent())
