"""`calibrate`: the smallest parameter (e.g. a noise multiplier) whose event spends at most (ε, δ), by root finding
over the accountant itself."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np
import scipy.optimize
from dp_accounting import dp_event as dpe

from jdp.accounting.events import (ADD_OR_REMOVE_ONE, Relation, _contains, _epsilon_and_order, check_relation,
                                   compute_epsilon, default_orders)
from jdp.validation import MAX_EPSILON, check_delta, check_epsilon

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
    spend = _Spend(make_event, delta, accountant, all_orders, relation, lo, hi,
                   windowed=accountant == "rdp" and not _contains(make_event(hi), dpe.RandomizedResponseDpEvent))
    xtol = 1e-6 if tol is None else max(float(tol) / hi, 1e-12)
    a, b = _bracket_root(spend, epsilon)
    if a is None:
        return float(lo)
    return _brent_root(spend, epsilon, a, b, xtol)


@dataclasses.dataclass
class _Spend:
    """ε at parameter e^x (clamped to the bracket [lo, hi]); with RDP over a window of orders slid to
    the order attaining it (a bound: never below ε over every order). A parameter seen before is not accounted
    again (`_epsilon_and_order`). `centre`: index in `orders` of the order that attained ε last."""
    make_event: Callable[[float], dpe.DpEvent]
    delta: float
    accountant: str
    orders: tuple[float, ...]
    relation: Relation
    lo: float
    hi: float
    windowed: bool
    centre: int | None = None

    @property
    def log_lo(self) -> float:
        return math.log(self.lo)

    @property
    def log_hi(self) -> float:
        return math.log(self.hi)

    def param(self, x: float) -> float:
        return self.lo if x <= self.log_lo else self.hi if x >= self.log_hi else math.exp(x)

    def __call__(self, x: float, every_order: bool = False) -> float:
        event = self.make_event(self.param(x))
        if not self.windowed:  # pure parts: compute_epsilon's PLD / basic-composition rule
            return compute_epsilon(event, self.delta, self.accountant, self.orders, self.relation)
        if every_order or self.centre is None:
            eps, order = _epsilon_and_order(event, self.delta, self.accountant, self.orders, self.relation)
            self.centre = _nearest(self.orders, order)
            return eps
        for _ in range(len(self.orders)):
            first = max(0, self.centre - _ORDER_WINDOW)
            window = self.orders[first:self.centre + _ORDER_WINDOW + 1]
            eps, order = _epsilon_and_order(event, self.delta, self.accountant, window, self.relation)
            nearest = _nearest(self.orders, order)
            moved, self.centre = nearest != self.centre, nearest
            if not moved or not (order == window[0] > self.orders[0] or order == window[-1] < self.orders[-1]):
                break  # not at an edge the orders extend beyond: a local optimum
        return eps


def _bracket_root(spend: _Spend, epsilon: float) -> tuple[float | None, float]:
    """(a, b) in log-parameter with spend(a) > ε ≥ spend(b), walked by steps of ×4 from 1 (clamped to the
    bracket; noise multipliers are O(1)), so Brent starts on a narrow interval: ~10 accountant calls instead of
    ~16 from the whole bracket. Over every order: the windows' bound could put the lower end above the root.
    (None, lo) when the bracket's lower end already spends at most ε."""
    step, log_lo, log_hi = math.log(4.0), spend.log_lo, spend.log_hi
    a = b = min(max(0.0, log_lo), log_hi)
    if spend(a, True) - epsilon > 0.0:
        while spend(b, True) - epsilon > 0.0:
            if b >= log_hi:
                raise ValueError(f"cannot reach epsilon={epsilon} at delta={spend.delta}: even parameter "
                                 f"{spend.hi} spends {spend(log_hi, every_order=True):.4g}")
            a, b = b, min(b + step, log_hi)
    else:
        while spend(a, True) - epsilon <= 0.0:
            if a <= log_lo:
                return None, log_lo
            a, b = max(a - step, log_lo), a
    return a, b


def _brent_root(spend: _Spend, epsilon: float, a: float, b: float, xtol: float) -> float:
    """The parameter in [e^a, e^b] found by Brent's method on the windows' bound, stepped up until it spends at
    most ε, and confirmed over every order (else Brent repeats below it; the last attempt uses every order)."""
    def excess(x: float, every_order: bool = False) -> float:
        return spend(x, every_order) - epsilon

    spend(b, every_order=True)  # the windows start at the order attaining ε at b, where their bound is exact
    for attempt in range(8):
        every = not spend.windowed or attempt == 7  # the last attempt searches over every order
        try:
            x = scipy.optimize.brentq(excess, a, b, args=(every,), xtol=xtol, rtol=1e-12)
        except ValueError:  # the windows missed b's optimum (several local optima over the orders): every order
            every = True
            x = scipy.optimize.brentq(excess, a, b, args=(every,), xtol=xtol, rtol=1e-12)
        up = 2.0 * xtol
        while x < b and excess(x, every) > 0.0:  # land on the side that spends at most ε
            x, up = min(b, x + up), 2.0 * up
        bound = spend(x, every)  # first: accounting x over every order moves the window to its optimum
        if every or spend(x, every_order=True) == bound:  # the windows' optimum is the optimum: the same root
            return spend.param(x)
        b = x  # spends at most ε over every order (at most the windows' bound): the root is at or below it
    return spend.param(b)


def _nearest(orders: Sequence[float], order: float) -> int:
    return int(np.argmin(np.abs(np.asarray(orders, np.float64) - order)))


# Orders on each side of the last optimum that `calibrate`'s windows hold (slid while the best is at an edge).
_ORDER_WINDOW = 4
