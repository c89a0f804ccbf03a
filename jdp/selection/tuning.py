"""Private choice of one configuration among K candidates (private hyper-parameter selection).

Each candidate c has a validation score q_c = -Σ_units ℓ_c(unit) where every unit's term lies in
[0, score_bound] (the caller bounds it, e.g. a per-user mean squared error of ratings in a public
range). Adding or removing one unit moves every q_c by at most score_bound and all in the same
direction, so the scores are monotone with sensitivity score_bound and a monotone ε-DP selection
mechanism (permute-and-flip by default) picks the configuration. The candidates' own training
releases must be accounted by the caller too (they all touch the data): see `jdp.altmin.tune_private`.
"""
from __future__ import annotations

import numpy as np

from jdp.accounting import PrivacyReport
from jdp.selection.batched import select
from jdp.selection.registry import get_mechanism
from jdp.validation import check_epsilon, check_positive


def selection_event(epsilon: float, mechanism: str = "pf", monotone: bool = True):
    """The dp_accounting event `select_configuration` records for these arguments (to budget it in advance)."""
    mech = get_mechanism(mechanism)
    params = {"monotone": True} if monotone and "monotone" in mech.params else {}
    return mech.dp_event(check_epsilon(epsilon), **params)


def select_configuration(key, scores, score_bound: float, epsilon: float, report: PrivacyReport | None = None,
                         mechanism: str = "pf", monotone: bool = True, name: str = "hyper-parameter selection") -> int:
    """Index of the chosen configuration, selected with an ε-DP mechanism on `scores` [K].

    Unit of privacy: whatever unit `score_bound` bounds (one user's total contribution to every score).
    `monotone=True` is valid only when a unit's term enters every score with the same sign (as for a
    sum of per-unit losses). The release is recorded in `report` when given.
    """
    epsilon = check_epsilon(epsilon)
    score_bound = check_positive(score_bound, "score_bound")
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 1 or scores.size < 2:
        raise ValueError(f"scores must be a 1-D array of at least 2 candidates, got shape {scores.shape}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite")
    mech = get_mechanism(mechanism)
    params = {"monotone": True} if monotone and "monotone" in mech.params else {}
    idx = int(select(mechanism, key, scores, np.full(scores.size, score_bound), epsilon, **params))
    if report is not None:
        report.add(f"{name} ({mechanism}{', monotone' if params else ''}, K={scores.size})",
                   selection_event(epsilon, mechanism, monotone), sensitivity=score_bound)
    return idx


__all__ = ["select_configuration", "selection_event"]
