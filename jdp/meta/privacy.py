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
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import dp_accounting
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

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


def make_accountant(relation: str, accountant: str = "rdp") -> dp_accounting.PrivacyAccountant:
    if relation not in _RELATIONS:
        raise ValueError(f"relation must be one of {tuple(_RELATIONS)}, got {relation!r}")
    if accountant == "rdp":
        # the without-replacement RDP bound costs O(α) per integer order: use a sparser grid (fewer
        # orders can only give a larger, still valid, ε)
        orders = REPLACE_ONE_ORDERS if relation == REPLACE_ONE else acc.DEFAULT_RDP_ORDERS
        return rdp_privacy_accountant.RdpAccountant(list(orders), _RELATIONS[relation])
    if accountant == "pld":
        return pld_privacy_accountant.PLDAccountant(_RELATIONS[relation])
    raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")


def epsilon_of(event: dpe.DpEvent, delta: float, relation: str, accountant: str = "rdp") -> float:
    """ε at δ of `event` from a dp_accounting accountant under `relation`."""
    delta = acc.check_delta(delta)
    a = make_accountant(relation, accountant)
    if not a.supports(event):
        raise ValueError(f"{type(a).__name__} under {relation} does not support event {event}")
    a.compose(event)
    return float(a.get_epsilon(delta))


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
    """Smallest noise multiplier whose event spends at most (ε, δ) under `relation` (RDP accountant).

    add/remove events go through `jdp.accounting.calibrate`; the other relations need an accountant
    built with that relation, which the shared helper does not take yet, so they call
    dp_accounting.calibrate_dp_mechanism directly with the same explicit-bracket convention.
    """
    epsilon, delta = acc.check_epsilon(epsilon), acc.check_delta(delta)
    if relation == ADD_REMOVE:
        return acc.calibrate(make_event, epsilon, delta, bracket=bracket, tol=1e-4)
    lo, hi = bracket
    if epsilon_of(make_event(hi), delta, relation) > epsilon:
        raise ValueError(f"cannot reach epsilon={epsilon} at delta={delta} with noise multiplier <= {hi}")
    if epsilon_of(make_event(lo), delta, relation) <= epsilon:
        return float(lo)
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(relation), make_event, epsilon, delta,
        dp_accounting.ExplicitBracketInterval(lo, hi), tol=1e-4))


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
@dataclasses.dataclass
class MetaPrivacyReport(acc.PrivacyReport):
    """PrivacyReport whose accountant uses the neighbouring relation of its events (see module doc).

    unit="task": neighbouring datasets differ in one task's whole dataset.
    """
    neighboring: str = ADD_REMOVE

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
            "pure_epsilon": None,
            "releases": [
                {"name": r.name, "event": repr(r.event), "sensitivity": r.sensitivity,
                 "noise_scale": r.noise_scale, "count": r.count}
                for r in self.releases
            ],
        }


def new_report(delta: float, relation: str) -> MetaPrivacyReport:
    return MetaPrivacyReport(delta=delta, unit="task", relation=RELATION_TEXT[relation], neighboring=relation)


def nonprivate_report(delta: float = 1e-5) -> MetaPrivacyReport:
    """Report of a non-private reference run: one NonPrivateDpEvent, ε = ∞."""
    r = new_report(delta, ADD_REMOVE)
    r.add("non-private meta-training (NOT differentially private)", dpe.NonPrivateDpEvent())
    return r
