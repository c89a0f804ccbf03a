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

Comparable ε: every MetaPrivacyReport also states ε under BOTH common relations (`epsilon_by_relation`),
recomputed by dp_accounting from each release's noise std and clip C, so methods accounted natively under
different relations can be put side by side:

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

import dataclasses
import functools
import math
from typing import Callable

import dp_accounting
from dp_accounting import dp_event as dpe

from jdp import accounting as acc

NeighborRel = dp_accounting.NeighboringRelation

ADD_REMOVE = "add_or_remove_one"
REPLACE_ONE = "replace_one"
REPLACE_SPECIAL = "replace_special"
_RELATIONS = {ADD_REMOVE: NeighborRel.ADD_OR_REMOVE_ONE, REPLACE_ONE: NeighborRel.REPLACE_ONE,
              REPLACE_SPECIAL: NeighborRel.REPLACE_SPECIAL}
RELATION_TEXT = {
    ADD_REMOVE: "add/remove one task's whole dataset",
    REPLACE_ONE: "replace one task's whole dataset by any other",
    REPLACE_SPECIAL: "replace one task's whole dataset by a null task (zero meta-gradient)",
}
SAMPLINGS = ("poisson", "fixed")
REPLACE_ONE_ORDERS = tuple([round(1.1 + 0.1 * i, 1) for i in range(99)] + list(range(11, 33))
                           + [40, 48, 56, 64, 96, 128])


def check_sampling(sampling: str) -> str:
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    return sampling


def relation_for_sampling(sampling: str) -> str:
    """The neighbouring relation under which dp_accounting supports the sampling's event."""
    return ADD_REMOVE if check_sampling(sampling) == "poisson" else REPLACE_ONE


def sensitivity_factor(relation: str) -> float:
    """L2 sensitivity of a sum of vectors clipped to norm C, in units of C, under `relation`."""
    return 2.0 if relation == REPLACE_ONE else 1.0


def _relation(relation: str) -> NeighborRel:
    if relation not in _RELATIONS:
        raise ValueError(f"relation must be one of {tuple(_RELATIONS)}, got {relation!r}")
    return _RELATIONS[relation]


def _orders(relation: str) -> tuple[float, ...]:
    # the without-replacement RDP bound costs O(α) per integer order: use a sparser grid (fewer orders
    # can only give a larger, still valid, ε)
    return REPLACE_ONE_ORDERS if relation == REPLACE_ONE else acc.DEFAULT_RDP_ORDERS


def make_accountant(relation: str, accountant: str = "rdp") -> dp_accounting.PrivacyAccountant:
    """jdp.accounting's accountant under `relation` (one of ADD_REMOVE, REPLACE_ONE, REPLACE_SPECIAL)."""
    return acc.make_accountant(None, accountant, _orders(relation), relation=_relation(relation))


def epsilon_of(event: dpe.DpEvent, delta: float, relation: str, accountant: str = "rdp") -> float:
    """ε at δ of `event` under `relation`, by jdp.accounting.compute_epsilon."""
    return acc.compute_epsilon(event, delta, accountant, _orders(relation), relation=_relation(relation))


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


def calibrate_noise_multiplier(make_event: Callable[[float], dpe.DpEvent], epsilon: float, delta: float,
                               relation: str, bracket: tuple[float, float] = (0.05, 500.0)) -> float:
    """Smallest noise multiplier whose event spends at most (ε, δ) under `relation` (RDP accountant),
    by jdp.accounting.calibrate."""
    return acc.calibrate(make_event, epsilon, delta, bracket=bracket, tol=1e-4, orders=_orders(relation),
                         relation=_relation(relation))


@functools.lru_cache(maxsize=256)
def calibrate_meta_sgd(epsilon: float, delta: float, n_tasks: int, batch_size: int, steps: int,
                       sampling: str) -> float:
    """Noise multiplier of `meta_sgd_event` meeting (ε, δ) under the sampling's relation (cached)."""
    return calibrate_noise_multiplier(lambda s: meta_sgd_event(s, n_tasks, batch_size, steps, sampling),
                                      epsilon, delta, relation_for_sampling(sampling))


@functools.lru_cache(maxsize=256)
def calibrate_tree(epsilon: float, delta: float, n_steps: int) -> float:
    """Noise multiplier of `tree_event` meeting (ε, δ) under REPLACE_SPECIAL (cached)."""
    return calibrate_noise_multiplier(lambda s: tree_event(s, n_steps), epsilon, delta, REPLACE_SPECIAL)


def theory_noise(epsilon: float, delta: float, n_tasks: int, steps: int, grad_bound: float) -> tuple[float, int]:
    """Alg. 1's closed-form calibration: (σ, m) with σ² = 8T(2L+b)² log(1/δ)/(K²ε²), m = max(K√(ε/4T), 1).

    σ is the std of the noise added to the *mean* meta-gradient. This is the paper's bound (Bassily et
    al. 2019, Thm 3.1), kept for comparison; jdp still reports the ε that dp_accounting gives for the
    mechanism actually run with this σ.
    """
    epsilon, delta = acc.check_epsilon(epsilon), acc.check_delta(delta)
    grad_bound = acc.check_positive(grad_bound, "grad_bound")
    _check_counts(n_tasks, 1, steps)
    sigma = math.sqrt(8.0 * steps * grad_bound ** 2 * math.log(1.0 / delta) / (n_tasks ** 2 * epsilon ** 2))
    m = max(int(round(n_tasks * math.sqrt(epsilon / (4.0 * steps)))), 1)
    return sigma, min(m, n_tasks)


# ----------------------------------------------------------------------------------------------------
MECHANISMS = ("poisson", "fixed", "tree")


def event_under(mechanism: str, relation: str, noise_std: float, clip: float, *, n_tasks: int = 1,
                batch_size: int = 1, steps: int = 1) -> tuple[dpe.DpEvent, str] | None:
    """(event, accountant) describing `mechanism` under `relation` (ADD_REMOVE or REPLACE_ONE), or None when
    that relation is not defined for it (table in the module doc). noise_std and clip are those of the
    run; each event's multiplier is std / sensitivity in dp_accounting's convention for that relation."""
    noise_std, clip = acc.check_positive(noise_std, "noise_std"), acc.check_positive(clip, "clip")
    if relation not in (ADD_REMOVE, REPLACE_ONE):
        raise ValueError(f"relation must be {ADD_REMOVE!r} or {REPLACE_ONE!r}, got {relation!r}")
    z = noise_std / clip
    if mechanism == "poisson":
        step = dpe.PoissonSampledDpEvent(int(batch_size) / int(n_tasks), dpe.GaussianDpEvent(z))
        return dpe.SelfComposedDpEvent(step, int(steps)), ("rdp" if relation == ADD_REMOVE else "pld")
    if mechanism == "fixed":
        return None if relation == ADD_REMOVE else (meta_sgd_event(z / 2, n_tasks, batch_size, steps, "fixed"), "rdp")
    if mechanism == "tree":
        return tree_event(z if relation == ADD_REMOVE else z / 2, steps), "rdp"
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")


@functools.lru_cache(maxsize=256)  # a PLD over many steps takes seconds; reports print it more than once
def epsilon_under(mechanism: str, relation: str, noise_std: float, clip: float, delta: float, *,
                  n_tasks: int = 1, batch_size: int = 1, steps: int = 1) -> float | None:
    """ε at δ of `mechanism` under `relation` by dp_accounting (None when not defined; see event_under).
    The accountant is the one event_under names (PLD for Poisson under replace-one: RDP has no bound for
    it; tighter than RDP, so compare cells of one accountant where it matters)."""
    got = event_under(mechanism, relation, noise_std, clip, n_tasks=n_tasks, batch_size=batch_size, steps=steps)
    if got is None:
        return None
    event, accountant = got
    # the tree event is analysed by dp_accounting under REPLACE_SPECIAL only (module doc)
    native = REPLACE_SPECIAL if mechanism == "tree" else relation
    return epsilon_of(event, delta, native, accountant)


@dataclasses.dataclass
class MetaPrivacyReport(acc.PrivacyReport):
    """PrivacyReport whose accountant uses the neighbouring relation of its events (see module doc).

    unit="task": neighbouring datasets differ in one task's whole dataset. `mechanisms` keeps, per
    release, what `epsilon_by_relation` needs to restate ε under add/remove and under replace-one.
    """
    neighboring: str = ADD_REMOVE
    mechanisms: list = dataclasses.field(default_factory=list)

    def add_mechanism(self, name: str, mechanism: str, noise_std: float, clip: float, *, n_tasks: int,
                      batch_size: int, steps: int) -> "MetaPrivacyReport":
        """Records one meta-training release from its noise std and clip C (native event and sensitivity)."""
        noise_std, clip = acc.check_positive(noise_std, "noise_std"), acc.check_positive(clip, "clip")
        counts = dict(n_tasks=int(n_tasks), batch_size=int(batch_size), steps=int(steps))
        if mechanism == "tree":
            event, sens = tree_event(noise_std / clip, steps), clip
        elif mechanism in SAMPLINGS:
            sens = sensitivity_factor(relation_for_sampling(mechanism)) * clip
            event = meta_sgd_event(noise_std / sens, n_tasks, batch_size, steps, mechanism)
        else:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        self.add(name, event, sens, noise_std)
        self.mechanisms.append(dict(mechanism=mechanism, noise_std=noise_std, clip=clip, **counts))
        return self

    def epsilon_by_relation(self, delta: float | None = None) -> dict[str, float | None]:
        """{relation: ε} under add/remove one task and replace one task, by dp_accounting (module doc);
        None where a release is not defined under that relation. With several releases they compose
        per relation only when each is a single mechanism (the meta algorithms release one each)."""
        delta = self.delta if delta is None else acc.check_delta(delta)
        if not self.mechanisms:  # nothing released (0) or a non-private run (inf): the same under both
            eps = self.epsilon(delta)
            return {ADD_REMOVE: eps if eps in (0.0, math.inf) else None,
                    REPLACE_ONE: eps if eps in (0.0, math.inf) else None}
        if len(self.mechanisms) != 1:
            raise ValueError("epsilon_by_relation supports one meta-training release per report")
        (m,) = self.mechanisms
        return {rel: epsilon_under(m["mechanism"], rel, m["noise_std"], m["clip"], delta, n_tasks=m["n_tasks"],
                                   batch_size=m["batch_size"], steps=m["steps"])
                for rel in (ADD_REMOVE, REPLACE_ONE)}

    def __post_init__(self):
        super().__post_init__()
        if self.neighboring not in _RELATIONS:
            raise ValueError(f"neighboring must be one of {tuple(_RELATIONS)}, got {self.neighboring!r}")

    def epsilon(self, delta: float | None = None) -> float:
        if not self.releases:
            return 0.0
        return epsilon_of(self.event(), self.delta if delta is None else delta, self.neighboring, self.accountant)

    def to_dict(self) -> dict:
        a = make_accountant(self.neighboring, self.accountant)
        return {
            "unit": self.unit,
            "neighbouring_relation": self.relation,
            "dp_accounting_relation": self.neighboring,
            "accountant": type(a).__name__,
            "delta": self.delta,
            "epsilon": self.epsilon(),
            "epsilon_by_relation": self.epsilon_by_relation(),
            "epsilon_by_relation_accountant": {
                rel: (None if not self.mechanisms or len(self.mechanisms) != 1 else
                      (lambda got: None if got is None else got[1])(event_under(
                          self.mechanisms[0]["mechanism"], rel, self.mechanisms[0]["noise_std"],
                          self.mechanisms[0]["clip"], n_tasks=self.mechanisms[0]["n_tasks"],
                          batch_size=self.mechanisms[0]["batch_size"], steps=self.mechanisms[0]["steps"])))
                for rel in (ADD_REMOVE, REPLACE_ONE)},
            "pure_epsilon": None,
            "assumptions": list(self.assumptions),
            "releases": [
                {"name": r.name, "event": repr(r.event), "sensitivity": r.sensitivity,
                 "noise_scale": r.noise_scale, "count": r.count}
                for r in self.releases
            ],
        }


    def __str__(self) -> str:
        lines = [super().__str__(), f"  native relation: {self.neighboring}"]
        for rel, eps in self.epsilon_by_relation().items():
            lines.append(f"  epsilon under {RELATION_TEXT[rel]}: " + ("not defined" if eps is None else f"{eps:.4f}"))
        return "\n".join(lines)


def new_report(delta: float, relation: str) -> MetaPrivacyReport:
    return MetaPrivacyReport(delta=delta, unit="task", relation=RELATION_TEXT[relation], neighboring=relation)


def nonprivate_report(delta: float = 1e-5) -> MetaPrivacyReport:
    """Report of a non-private reference run: one NonPrivateDpEvent, ε = ∞."""
    r = new_report(delta, ADD_REMOVE)
    r.add("non-private meta-training (NOT differentially private)", dpe.NonPrivateDpEvent())
    return r
