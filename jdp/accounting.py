"""Privacy accounting over dp_accounting: events, calibration and the PrivacyReport.

Every private routine in jdp describes what it released as `dp_accounting` events and records them in
a `PrivacyReport`. Totals always come from a dp_accounting accountant (RDP by default, PLD where the
events need it), never from hand-derived formulas.

Neighbouring relation: data, not text. Every accountant, ε computation, calibration, release and report
names one of dp_accounting's relations between datasets that differ in one privacy unit (a user, a
task, ...): ADD_OR_REMOVE_ONE (the default), REPLACE_ONE (that unit's data replaced by any other) or
REPLACE_SPECIAL (replaced by a fixed null unit). A noise multiplier is std / sensitivity *under the
event's relation*. Releases of different relations never compose by accident: a report refuses them;
a release may carry `Restatement`s (the same mechanism's event under another relation) so reports can
state ε under several relations side by side (`PrivacyReport.epsilon_by_relation`).

Pure ε-DP releases are represented by their tight dominating pair, binary randomized response with
parameter ε (`pure_dp_event`); those are composed with the PLD accountant under dp_accounting's
REPLACE_ONE relation (RR's loss between two different inputs is exactly ε; an ε-DP mechanism is
ε-indistinguishable for any pair of neighbours of the report's relation, so this dominates it). This holds
for reports under ADD_OR_REMOVE_ONE and REPLACE_SPECIAL alike: under REPLACE_SPECIAL dp_accounting
analyses randomized response against a "special" input whose output is uniform, which is not the worst
case of a general ε-DP mechanism (one ε = 1 selection came out as ε = 0.625, five as 3.10), so a
pure-DP event is never handed to an accountant under that relation.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Callable, Sequence

import attr
import dp_accounting
import numpy as np
import scipy.optimize
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from jdp.validation import MAX_EPSILON, check_delta, check_epsilon, check_positive, large_epsilon_warning

Relation = dp_accounting.NeighboringRelation
ADD_OR_REMOVE_ONE = Relation.ADD_OR_REMOVE_ONE
REPLACE_ONE = Relation.REPLACE_ONE
REPLACE_SPECIAL = Relation.REPLACE_SPECIAL
_RELATION_TEXT = {
    ADD_OR_REMOVE_ONE: "add or remove all data of one {unit}",
    REPLACE_ONE: "replace all data of one {unit} by any other",
    REPLACE_SPECIAL: "replace all data of one {unit} by a fixed null {unit}",
}

# The orders of the DPALS reference (1.1..10.9 step 0.1, 11..63) plus larger ones for low-noise runs.
DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    [round(1.1 + 0.1 * i, 1) for i in range(99)] + list(range(11, 64)) + [80, 96, 128, 192, 256, 512, 1024]
)
REFERENCE_RDP_ORDERS: tuple[float, ...] = tuple([round(1.1 + 0.1 * i, 1) for i in range(99)] + list(range(11, 64)))
# Under REPLACE_ONE the without-replacement RDP bound costs O(α) per integer order: a sparser grid (fewer
# orders can only give a larger, still valid, ε).
REPLACE_ONE_RDP_ORDERS: tuple[float, ...] = tuple([round(1.1 + 0.1 * i, 1) for i in range(99)] + list(range(11, 33))
                                                  + [40, 48, 56, 64, 96, 128])


def check_relation(relation: Relation | str) -> Relation:
    """A dp_accounting NeighboringRelation, given as the enum or its name ("add_or_remove_one", ...)."""
    if isinstance(relation, Relation):
        return relation
    if isinstance(relation, str) and relation.upper() in Relation.__members__:
        return Relation[relation.upper()]
    names = ", ".join(r.name.lower() for r in Relation)
    raise ValueError(f"relation must be a dp_accounting NeighboringRelation or one of its names ({names}), "
                     f"got {relation!r}")


def describe_relation(relation: Relation | str, unit: str = "user") -> str:
    """The relation in words for a privacy unit, e.g. 'add or remove all data of one user'."""
    return _RELATION_TEXT[check_relation(relation)].format(unit=unit)


def default_orders(relation: Relation | str = ADD_OR_REMOVE_ONE) -> tuple[float, ...]:
    """The RDP orders jdp uses under `relation`."""
    return REPLACE_ONE_RDP_ORDERS if check_relation(relation) is REPLACE_ONE else DEFAULT_RDP_ORDERS


# ----------------------------------------------------------------------------------------------------
# Events.
def gaussian_event(noise_multiplier: float) -> dpe.DpEvent:
    """Gaussian mechanism with noise std = noise_multiplier * L2 sensitivity."""
    check_positive(noise_multiplier, "noise_multiplier")
    return dpe.GaussianDpEvent(float(noise_multiplier))


def pure_dp_event(epsilon: float) -> dpe.DpEvent:
    """Tight dominating event for ANY ε-DP mechanism: binary randomized response with parameter ε.

    RR over 2 buckets with noise p keeps the input w.p. 1 - p/2, so its privacy loss is
    log((1 - p/2)/(p/2)) = ε for p = 2/(1 + e^ε). Composition via PLD is then exact for pure DP.
    """
    epsilon = check_epsilon(epsilon)
    # 2/(1+e^ε) written with e^(-ε): no overflow for large ε (a calibration bracket probes ε up to 1e3);
    # past ε ≈ 745 it is 0, i.e. no noise and an infinite ε, which is what such an event spends.
    tail = math.exp(-epsilon)
    return dpe.RandomizedResponseDpEvent(noise_parameter=2.0 * tail / (1.0 + tail), num_buckets=2)


def _contains(event: dpe.DpEvent, kind: type) -> bool:
    if isinstance(event, kind):
        return True
    if isinstance(event, dpe.ComposedDpEvent):
        return any(_contains(e, kind) for e in event.events)
    inner = getattr(event, "event", None)
    return inner is not None and _contains(inner, kind)


def _expand_pure(event: dpe.DpEvent) -> dpe.DpEvent:
    """Rewrites SelfComposed(…RR…, n) as n explicit copies: dp_accounting's PLD accountant ignores the
    count of a self-composed randomized-response event (it composes it once), which would under-count."""
    if isinstance(event, dpe.ComposedDpEvent):
        return dpe.ComposedDpEvent([_expand_pure(e) for e in event.events])
    if isinstance(event, dpe.SelfComposedDpEvent) and _contains(event.event, dpe.RandomizedResponseDpEvent):
        inner = _expand_pure(event.event)
        return dpe.ComposedDpEvent([inner] * event.count)
    return event


def _only_pure(event: dpe.DpEvent) -> bool:
    if isinstance(event, (dpe.RandomizedResponseDpEvent, dpe.NoOpDpEvent)):
        return True
    if isinstance(event, dpe.ComposedDpEvent):
        return all(_only_pure(e) for e in event.events)
    return isinstance(event, dpe.SelfComposedDpEvent) and _only_pure(event.event)


def _split_pure(event: dpe.DpEvent) -> tuple[list, list] | None:
    """(pure-DP parts, other parts) of a composition; None when one part mixes both kinds."""
    if isinstance(event, dpe.ComposedDpEvent):
        pure, other = [], []
        for part in event.events:
            split = _split_pure(part)
            if split is None:
                return None
            pure, other = pure + split[0], other + split[1]
        return pure, other
    if _only_pure(event):
        return [event], []
    return None if _contains(event, dpe.RandomizedResponseDpEvent) else ([], [event])


# Relations under which a pure-DP event (`pure_dp_event`) is composed by PLD under REPLACE_ONE instead: there its
# randomized-response pair is the worst case of any ε-DP mechanism; add/remove has no analysis of it and
# REPLACE_SPECIAL's (against a uniform output) under-counts a general ε-DP mechanism.
_PURE_VIA_REPLACE_ONE = (ADD_OR_REMOVE_ONE, REPLACE_SPECIAL)


def make_accountant(event: dpe.DpEvent | None = None, accountant: str = "rdp",
                    orders: Sequence[float] | None = None, pld_discretization: float = 1e-4,
                    relation: Relation | str = ADD_OR_REMOVE_ONE) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant; 'rdp' (default) or 'pld', under `relation` (events' noise multipliers are
    stated for that relation; orders default to `default_orders(relation)`). Under add/remove and
    replace-special, pure-DP (randomized-response) events need PLD under REPLACE_ONE, chosen automatically;
    they cannot be mixed with subsampled events, whose noise multipliers are stated for the report's relation."""
    relation = check_relation(relation)
    orders = default_orders(relation) if orders is None else orders
    if (relation in _PURE_VIA_REPLACE_ONE and event is not None
            and _contains(event, dpe.RandomizedResponseDpEvent)):
        for sampled in (dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent,
                        dpe.SampledWithReplacementDpEvent):
            if _contains(event, sampled):
                raise ValueError("pure-DP events cannot be composed with subsampled events in one report")
        return pld_privacy_accountant.PLDAccountant(REPLACE_ONE, pld_discretization)
    if accountant == "rdp":
        return rdp_privacy_accountant.RdpAccountant(list(orders), relation)
    if accountant == "pld":
        return pld_privacy_accountant.PLDAccountant(relation, pld_discretization)
    raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")


def compute_epsilon(event: dpe.DpEvent, delta: float, accountant: str = "rdp",
                    orders: Sequence[float] | None = None,
                    relation: Relation | str = ADD_OR_REMOVE_ONE) -> float:
    """ε at the given δ of a (composed) event under `relation`, from dp_accounting accountants.

    Pure-DP events (under add/remove or replace-special): dp_accounting composes randomized response as the
    worst case of an ε-DP mechanism only under REPLACE_ONE (`make_accountant`), where a Gaussian event counts
    with twice its add/remove (or replace-special) sensitivity. Mixed with other events, the result is the
    smaller of (a) that joint REPLACE_ONE composition and (b) basic composition of the other events' (ε₁, δ)
    under `relation` with the pure part's (ε₂, 0): both are valid bounds.
    """
    delta, relation = check_delta(delta), check_relation(relation)
    orders = default_orders(relation) if orders is None else orders
    if relation not in _PURE_VIA_REPLACE_ONE:
        return _accounted_epsilon(event, delta, accountant, orders, relation)
    split = _split_pure(event) if _contains(event, dpe.RandomizedResponseDpEvent) else None
    if split is not None and split[0] and split[1]:
        pure = _accounted_epsilon(dpe.ComposedDpEvent(split[0]), 0.0, accountant, orders, relation)
        basic = _accounted_epsilon(dpe.ComposedDpEvent(split[1]), delta, accountant, orders, relation) + pure
        try:
            return min(basic, _accounted_epsilon(event, delta, accountant, orders, relation))
        except ValueError:  # subsampled events cannot join the REPLACE_ONE composition
            return basic
    return _accounted_epsilon(event, delta, accountant, orders, relation)


class _DroppedOrders(logging.Filter):
    """Counts (and hides) dp_accounting's per-order 'failed to converge' log lines."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed to converge" in record.getMessage():
            self.count += 1
            return False
        return True


# ε of events already accounted in this process: a report is printed and saved, a run's last epoch states
# what its report states, a calibration re-checks its root; dp_accounting's RDP of a Poisson-subsampled
# Gaussian costs ~0.1 s per event. The key holds every field's exact bytes (not the repr: numpy prints an
# array's floats to 8 digits and elides long arrays, so two different events could share a repr).
_ACCOUNTED: dict[tuple, tuple[float, int, float | None]] = {}
_ACCOUNTED_MAX = 4096


def _event_key(value):
    """An exact, hashable key of an event (classes, field names, each number's dtype and bytes), or None for a
    field of a kind it cannot key exactly (such an event is accounted afresh every time)."""
    if attr.has(type(value)):
        parts = tuple((f.name, _event_key(getattr(value, f.name))) for f in attr.fields(type(value)))
        return None if any(k is None for _, k in parts) else (type(value).__qualname__, parts)
    if isinstance(value, (list, tuple)):
        parts = tuple(map(_event_key, value))
        return None if any(k is None for k in parts) else ("seq", parts)
    if value is None or isinstance(value, str):
        return ("v", value)
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is simply not memoised
        return None
    if array.dtype.kind not in "biuf":
        return None
    return ("a", array.dtype.str, array.shape, array.tobytes())


def _canonical(event: dpe.DpEvent) -> dpe.DpEvent:
    """The same mechanism in one spelling: nested compositions flattened, SelfComposed(SelfComposed(e, a), b)
    as SelfComposed(e, a·b), single-event compositions unwrapped (so a report and a run's last epoch, built
    differently, share one accounting)."""
    if isinstance(event, dpe.ComposedDpEvent):
        parts = []
        for e in map(_canonical, event.events):
            parts.extend(e.events if isinstance(e, dpe.ComposedDpEvent) else [e])
        return parts[0] if len(parts) == 1 else dpe.ComposedDpEvent(parts)
    if isinstance(event, dpe.SelfComposedDpEvent):
        inner, count = _canonical(event.event), int(event.count)
        if isinstance(inner, dpe.SelfComposedDpEvent):
            inner, count = inner.event, int(inner.count) * count
        return inner if count == 1 else dpe.SelfComposedDpEvent(inner, count)
    return event


def _accounted_epsilon(event: dpe.DpEvent, delta: float, accountant: str, orders: Sequence[float],
                       relation: Relation = ADD_OR_REMOVE_ONE) -> float:
    return _epsilon_and_order(event, delta, accountant, orders, relation)[0]


def _epsilon_and_order(event: dpe.DpEvent, delta: float, accountant: str, orders: Sequence[float],
                       relation: Relation = ADD_OR_REMOVE_ONE) -> tuple[float, float | None]:
    """(ε at δ, the RDP order that attains it, or None from a PLD accountant), memoised per exact event."""
    event = _canonical(event)
    event_key = _event_key(event)
    if event_key is None:
        eps, dropped, order = _account(event, delta, accountant, orders, relation)
        return _warn_dropped(eps, dropped), order
    key = (event_key, float(delta), accountant, tuple(float(o) for o in orders), relation.name)
    if key not in _ACCOUNTED:
        if len(_ACCOUNTED) >= _ACCOUNTED_MAX:
            _ACCOUNTED.clear()
        _ACCOUNTED[key] = _account(event, delta, accountant, orders, relation)
    eps, dropped, order = _ACCOUNTED[key]
    return _warn_dropped(eps, dropped), order


def _warn_dropped(eps: float, dropped: int) -> float:
    if dropped:
        warnings.warn("dp_accounting's RDP accountant excluded some orders whose computation did not "
                      "converge; epsilon is the minimum over the remaining orders (still a valid bound)",
                      RuntimeWarning, stacklevel=3)
    return eps


def _account(event: dpe.DpEvent, delta: float, accountant: str, orders: Sequence[float],
             relation: Relation) -> tuple[float, int, float | None]:
    """(ε at δ, the number of orders dp_accounting dropped, the RDP order attaining ε or None) of one event,
    by a fresh accountant."""
    event = _expand_pure(event)
    acc = make_accountant(event, accountant, orders, relation=relation)
    if not acc.supports(event):
        raise ValueError(f"the {type(acc).__name__} under {relation.name} does not support event {event}")
    # The RDP accountant logs one warning per order whose series does not converge (dozens per
    # calibration); it excludes those orders, so the bound over the remaining ones stays valid.
    dropped = _DroppedOrders()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(dropped)
    try:
        acc.compose(event)
        if isinstance(acc, rdp_privacy_accountant.RdpAccountant):
            eps, order = acc.get_epsilon_and_optimal_order(delta)
            eps, order = float(eps), float(order)
        else:
            eps, order = float(acc.get_epsilon(delta)), None
    finally:
        absl_logger.removeFilter(dropped)
    return eps, dropped.count, order


def calibrate(make_event: Callable[[float], dpe.DpEvent], epsilon: float, delta: float,
              bracket: tuple[float, float] = (1e-3, 1e5), accountant: str = "rdp",
              orders: Sequence[float] | None = None, tol: float | None = None,
              relation: Relation | str = ADD_OR_REMOVE_ONE) -> float:
    """Smallest parameter (e.g. noise multiplier) in `bracket` whose event spends at most (ε, δ) under
    `relation`.

    Root finding over `compute_epsilon` itself (the spend is non-increasing in the parameter): the root is
    bracketed by steps of ×4 from 1, then Brent's method on log(parameter) to a relative tolerance (about
    ten accountant calls instead of ~30 for bisection), then the returned parameter is checked and, if needed,
    stepped up until it spends at most ε by exactly the rule the report uses. `tol`: absolute tolerance on the
    parameter (default 1e-6 relative). Raises ValueError when the budget cannot be met inside the bracket (e.g.
    a fixed part of the budget already exceeds ε). Targets above `jdp.validation.MAX_EPSILON` are refused.

    With the RDP accountant, Brent's steps account only the orders near the one that attained ε last
    (`_ORDER_WINDOW` on each side, the window slid while its best order is at an edge; the bracket's walk uses
    every order): ε over a subset of the orders is never smaller, so the root of that bound spends at most ε
    over every order. The root is then accounted over every order: the same ε means the same root; otherwise
    Brent repeats below it. Most of the accountant's time went into orders far from the optimum (a 16-step
    DP-SGD run's σ: 14 calls over 159 orders, 1.4-1.6 s, some orders not converging; 1.5× less time over
    the packages' event shapes, `benchmarks/privacy/calibration.py`).
    """
    epsilon, delta, relation = check_epsilon(epsilon), check_delta(delta), check_relation(relation)
    if epsilon > MAX_EPSILON:  # refused before any accounting: such a search ends at the bracket's end anyway
        raise ValueError(f"epsilon = {epsilon:.4g} is above the largest target jdp calibrates for, {MAX_EPSILON:g} "
                         f"(jdp.validation.MAX_EPSILON): nothing is protected at such an epsilon")
    lo, hi = bracket
    if not (0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"bracket must satisfy 0 < lo < hi < inf, got {bracket!r}")
    all_orders = tuple(sorted(default_orders(relation) if orders is None else orders))
    log_lo, log_hi = math.log(lo), math.log(hi)
    xtol = 1e-6 if tol is None else max(float(tol) / hi, 1e-12)
    windowed = accountant == "rdp" and not _contains(make_event(hi), dpe.RandomizedResponseDpEvent)
    centre: list[int | None] = [None]  # index in all_orders of the order that attained ε last

    def param(x: float) -> float:
        return lo if x <= log_lo else hi if x >= log_hi else math.exp(x)

    def spends(x: float, every_order: bool = False) -> float:
        """ε at parameter e^x; with RDP over a window of orders slid to the order attaining it (a bound: never
        below ε over every order). A parameter seen before is not accounted again (`_epsilon_and_order`)."""
        event = make_event(param(x))
        if not windowed:  # pure parts: compute_epsilon's PLD / basic-composition rule
            return compute_epsilon(event, delta, accountant, all_orders, relation)
        if every_order or centre[0] is None:
            eps, order = _epsilon_and_order(event, delta, accountant, all_orders, relation)
            centre[0] = _nearest(all_orders, order)
            return eps
        for _ in range(len(all_orders)):
            first = max(0, centre[0] - _ORDER_WINDOW)
            window = all_orders[first:centre[0] + _ORDER_WINDOW + 1]
            eps, order = _epsilon_and_order(event, delta, accountant, window, relation)
            nearest = _nearest(all_orders, order)
            moved, centre[0] = nearest != centre[0], nearest
            if not moved or not (order == window[0] > all_orders[0] or order == window[-1] < all_orders[-1]):
                break  # not at an edge the orders extend beyond: a local optimum
        return eps

    def excess(x: float, every_order: bool = False) -> float:
        return spends(x, every_order) - epsilon

    # Bracket the root by steps of ×4 from 1 (clamped to the bracket; noise multipliers are O(1)), so Brent
    # starts on a narrow interval: ~10 accountant calls instead of ~16 from the whole bracket. Over every order:
    # the windows' bound could put the lower end above the root.
    step = math.log(4.0)
    a = b = min(max(0.0, log_lo), log_hi)
    if excess(a, True) > 0.0:
        while excess(b, True) > 0.0:
            if b >= log_hi:
                raise ValueError(f"cannot reach epsilon={epsilon} at delta={delta}: even parameter {hi} spends "
                                 f"{spends(log_hi, every_order=True):.4g}")
            a, b = b, min(b + step, log_hi)
    else:
        while excess(a, True) <= 0.0:
            if a <= log_lo:
                return float(lo)
            a, b = max(a - step, log_lo), a
    spends(b, every_order=True)  # the windows start at the order attaining ε at b, where their bound is exact
    for attempt in range(8):
        every = not windowed or attempt == 7  # the last attempt searches over every order
        try:
            x = scipy.optimize.brentq(excess, a, b, args=(every,), xtol=xtol, rtol=1e-12)
        except ValueError:  # the windows missed b's optimum (several local optima over the orders): every order
            every = True
            x = scipy.optimize.brentq(excess, a, b, args=(every,), xtol=xtol, rtol=1e-12)
        up = 2.0 * xtol
        while x < b and excess(x, every) > 0.0:  # land on the side that spends at most ε
            x, up = min(b, x + up), 2.0 * up
        bound = spends(x, every)  # first: accounting x over every order moves the window to its optimum
        if every or spends(x, every_order=True) == bound:  # the windows' optimum is the optimum: the same root
            return param(x)
        b = x  # spends at most ε over every order (at most the windows' bound): the root is at or below it
    return param(b)


def _nearest(orders: Sequence[float], order: float) -> int:
    return int(np.argmin(np.abs(np.asarray(orders, np.float64) - order)))


# Orders on each side of the last optimum that `calibrate`'s windows hold (slid while the best is at an edge).
_ORDER_WINDOW = 4


# ----------------------------------------------------------------------------------------------------
# PrivacyReport.
NONPRIVATE_TUNING = ("hyper-parameters chosen non-privately on validation data: that choice is not "
                     "accounted in epsilon")


@dataclasses.dataclass(frozen=True)
class Restatement:
    """A release described under another neighbouring relation, to compare mechanisms accounted natively
    under different ones: `event`, composed by `accountant` under dp_accounting's `accounted_under`
    relation (default: `relation` itself), bounds the release's privacy loss under `relation`. E.g. a
    Poisson-sampled Gaussian (native: add/remove, sensitivity C) restated under replace-one is the same
    event under PLD REPLACE_ONE, whose pair is the mixture shifted by ±C, i.e. outputs 2C apart."""
    relation: Relation
    event: dpe.DpEvent
    accountant: str = "rdp"
    accounted_under: Relation | None = None

    def __post_init__(self):
        object.__setattr__(self, "relation", check_relation(self.relation))
        under = self.relation if self.accounted_under is None else check_relation(self.accounted_under)
        object.__setattr__(self, "accounted_under", under)


@dataclasses.dataclass(frozen=True)
class Release:
    """One release: what was published, its event under `relation`, its L2/L1 sensitivity under that
    relation, noise scale (std), and optional restatements under other relations."""
    name: str
    event: dpe.DpEvent
    sensitivity: float | None = None
    noise_scale: float | None = None
    count: int = 1  # number of identical releases (self-composed)
    relation: Relation = ADD_OR_REMOVE_ONE
    restated: tuple[Restatement, ...] = ()

    def composed_event(self, event: dpe.DpEvent | None = None) -> dpe.DpEvent:
        event = self.event if event is None else event
        return event if self.count == 1 else dpe.SelfComposedDpEvent(event, self.count)

    def under(self, relation: Relation) -> tuple[dpe.DpEvent, str | None, Relation] | None:
        """(composed event, accountant or None for the report's, relation to account it under) describing
        this release under `relation`; None when it has no description there. A non-private release is
        non-private under every relation."""
        if relation is self.relation or _contains(self.event, dpe.NonPrivateDpEvent):
            return self.composed_event(), None, self.relation
        for r in self.restated:
            if r.relation is relation:
                return self.composed_event(r.event), r.accountant, r.accounted_under
        return None


@dataclasses.dataclass
class PrivacyReport:
    """Ledger of every release of a private computation and their composed (ε, δ).

    `unit` names the privacy unit (e.g. "user"), `relation` the neighbouring relation between datasets
    that differ in one unit (a dp_accounting NeighboringRelation; add/remove by default) under which
    every release is stated and composed. `assumptions` lists what the guarantee takes as public or
    leaves out (a public item catalogue, declared sizes, hyper-parameters chosen non-privately): the ε
    holds only under them.
    """
    delta: float
    unit: str = "user"
    relation: Relation | str = ADD_OR_REMOVE_ONE
    accountant: str = "rdp"
    releases: list[Release] = dataclasses.field(default_factory=list)
    assumptions: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        check_delta(self.delta)
        self.relation = check_relation(self.relation)
        for r in self.releases:
            self._check_same_relation(r.relation, r.name)

    def _check_same_relation(self, relation: Relation, what: str) -> None:
        if relation is not self.relation:
            raise ValueError(f"{what} is stated under {relation.name} but this report composes under "
                             f"{self.relation.name}: describe it under {self.relation.name} (a Restatement) "
                             f"or keep it in its own report")

    def add(self, name: str, event: dpe.DpEvent, sensitivity: float | None = None,
            noise_scale: float | None = None, count: int = 1, relation: Relation | str | None = None,
            restated: Sequence[Restatement] = ()) -> "PrivacyReport":
        """Records `count` releases of `event`, stated under `relation` (default and only allowed value:
        the report's), with optional restatements under other relations."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        relation = self.relation if relation is None else check_relation(relation)
        self._check_same_relation(relation, f"release {name!r}")
        self.releases.append(Release(name, event, None if sensitivity is None else float(sensitivity),
                                     None if noise_scale is None else float(noise_scale), int(count),
                                     relation, tuple(restated)))
        return self

    def add_release(self, release: Release) -> "PrivacyReport":
        """Records an existing Release (e.g. from another report) after checking its relation."""
        self._check_same_relation(release.relation, f"release {release.name!r}")
        self.releases.append(release)
        return self

    def extend(self, other: "PrivacyReport") -> "PrivacyReport":
        """Adds another report's releases and assumptions (same unit and relation only)."""
        if other.unit != self.unit:
            raise ValueError(f"cannot compose a report on unit {other.unit!r} into one on unit {self.unit!r}")
        self._check_same_relation(other.relation, "the other report")
        for r in other.releases:
            self.add_release(r)
        for a in other.assumptions:
            self.assume(a)
        return self

    def assume(self, text: str) -> "PrivacyReport":
        """Records an assumption the guarantee rests on (once; e.g. NONPRIVATE_TUNING)."""
        if text not in self.assumptions:
            self.assumptions.append(str(text))
        return self

    def add_gaussian(self, name: str, sensitivity: float, noise_std: float, count: int = 1) -> "PrivacyReport":
        """Records `count` Gaussian releases of a statistic with L2 sensitivity (under the report's
        relation) and noise std."""
        sensitivity, noise_std = check_positive(sensitivity, "sensitivity"), check_positive(noise_std, "noise_std")
        return self.add(name, gaussian_event(noise_std / sensitivity), sensitivity, noise_std, count)

    def event(self) -> dpe.DpEvent:
        return dpe.ComposedDpEvent([r.composed_event() for r in self.releases])

    def epsilon(self, delta: float | None = None) -> float:
        if not self.releases:
            return 0.0
        return compute_epsilon(self.event(), self.delta if delta is None else delta, self.accountant,
                               relation=self.relation)

    def _parts_under(self, relation: Relation) -> tuple[list, str, Relation] | None:
        parts = [r.under(relation) for r in self.releases]
        if any(p is None for p in parts):
            return None
        ways = {(acct or self.accountant, under) for _, acct, under in parts}
        if len(ways) != 1:
            raise ValueError(f"the releases' descriptions under {relation.name} need different accountants or "
                             f"relations ({sorted((a, u.name) for a, u in ways)}); they cannot be composed")
        (acct, under), = ways
        return [e for e, _, _ in parts], acct, under

    def epsilon_by_relation(self, relations: Sequence[Relation | str] = (ADD_OR_REMOVE_ONE, REPLACE_ONE),
                            delta: float | None = None) -> dict[Relation, float | None]:
        """{relation: ε at δ} from each release's event under that relation (its own or a Restatement),
        by dp_accounting; None where some release has no description under it."""
        delta = self.delta if delta is None else check_delta(delta)
        out: dict[Relation, float | None] = {}
        for rel in map(check_relation, relations):
            got = self._parts_under(rel) if self.releases else ([], self.accountant, rel)
            if got is None:
                out[rel] = None
            else:
                events, acct, under = got
                out[rel] = compute_epsilon(dpe.ComposedDpEvent(events), delta, acct, relation=under) if events else 0.0
        return out

    def pure_epsilon(self) -> float | None:
        """Σ ε over releases when every release is pure ε-DP (basic composition), else None."""
        total = 0.0
        for r in self.releases:
            if not isinstance(r.event, dpe.RandomizedResponseDpEvent) or r.event.num_buckets != 2:
                return None
            p = r.event.noise_parameter
            total += r.count * math.log((1 - p / 2) / (p / 2))
        return total

    def to_dict(self) -> dict:
        out = {
            "unit": self.unit,
            "neighbouring_relation": self.relation.name.lower(),
            "relation_text": describe_relation(self.relation, self.unit),
            "accountant": type(make_accountant(self.event() if self.releases else None, self.accountant,
                                               relation=self.relation)).__name__,
            "delta": self.delta,
            "epsilon": self.epsilon(),
            "pure_epsilon": self.pure_epsilon(),
            "assumptions": list(self.assumptions),
            "releases": [
                {"name": r.name, "event": repr(r.event), "relation": r.relation.name.lower(),
                 "sensitivity": r.sensitivity, "noise_scale": r.noise_scale, "count": r.count,
                 "restated_under": [s.relation.name.lower() for s in r.restated]}
                for r in self.releases
            ],
        }
        note = large_epsilon_warning(out["epsilon"], self.unit)
        if note is not None:  # ε > jdp.validation.LARGE_EPSILON: accepted, said beside the number
            out["warnings"] = [note]
        if any(r.restated for r in self.releases):
            by = self.epsilon_by_relation()
            out["epsilon_by_relation"] = {rel.name.lower(): eps for rel, eps in by.items()}
            out["epsilon_by_relation_accountant"] = {
                rel.name.lower(): (None if got is None else got[1])
                for rel, got in ((rel, self._parts_under(rel)) for rel in by)}
        return out

    def __str__(self) -> str:
        lines = [f"PrivacyReport: unit={self.unit} ({describe_relation(self.relation, self.unit)}), "
                 f"delta={self.delta:g}"]
        for r in self.releases:
            sens = "-" if r.sensitivity is None else f"{r.sensitivity:.4g}"
            noise = "-" if r.noise_scale is None else f"{r.noise_scale:.4g}"
            lines.append(f"  {r.name:<32} x{r.count:<4} sens={sens:<10} noise={noise:<10} {type(r.event).__name__}")
        total = self.epsilon()
        lines.append(f"  total epsilon = {total:.4f}")
        note = large_epsilon_warning(total, self.unit)
        if note is not None:
            lines.append(f"  WARNING: {note}")
        if any(r.restated for r in self.releases):
            for rel, eps in self.epsilon_by_relation().items():
                lines.append(f"  epsilon under '{describe_relation(rel, self.unit)}': "
                             + ("not defined" if eps is None else f"{eps:.4f}"))
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)


def epsilons_from_orders(event: dpe.DpEvent, delta: float, orders: Sequence[float]) -> tuple[float, float]:
    """(ε, optimal order) from the RDP accountant, for diagnostics."""
    acc = rdp_privacy_accountant.RdpAccountant(list(orders))
    acc.compose(event)
    eps, order = acc.get_epsilon_and_optimal_order(check_delta(delta))
    return float(eps), float(order)


__all__ = [
    "ADD_OR_REMOVE_ONE", "DEFAULT_RDP_ORDERS", "NONPRIVATE_TUNING", "REFERENCE_RDP_ORDERS", "REPLACE_ONE",
    "REPLACE_ONE_RDP_ORDERS", "REPLACE_SPECIAL", "PrivacyReport", "Relation", "Release", "Restatement", "calibrate",
    "check_relation", "compute_epsilon", "default_orders",
    "describe_relation", "gaussian_event", "make_accountant", "pure_dp_event", "epsilons_from_orders",
]
