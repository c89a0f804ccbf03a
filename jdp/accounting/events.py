"""Neighbouring relations, dp_accounting events and ε: `compute_epsilon` over a fresh accountant per exact event
(memoised), with pure-DP parts composed as the package docstring says."""
from __future__ import annotations

import logging
import math
import warnings
from typing import Sequence

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from jdp.validation import check_delta, check_epsilon, check_positive

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


def epsilons_from_orders(event: dpe.DpEvent, delta: float, orders: Sequence[float]) -> tuple[float, float]:
    """(ε, optimal order) from the RDP accountant, for diagnostics."""
    acc = rdp_privacy_accountant.RdpAccountant(list(orders))
    acc.compose(event)
    eps, order = acc.get_epsilon_and_optimal_order(check_delta(delta))
    return float(eps), float(order)
