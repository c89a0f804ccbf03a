"""Canary-user audits of DP alternating minimization (`jdp.altmin.fit`): an empirical lower bound on ε.

Unit: a user; relation: add/remove all ratings of one user. The audit fits the model through the public API on
background ratings (`jdp.data.planted_powerlaw`) plus canary users, each included independently with
probability 1/2. Canary i rates `items_per_canary` items of its own, which nobody else rates, at the top of the
rating scale: the worst case the user-level sensitivity is stated for (all of the user's ratings on aligned
features, the whole budget spent). Score: the sum of the released item biases over the canary's items (the
model's item factors V are ignored: at these sizes the default rank is 0). The declared public sizes
(`n_users`, `n_items`) are the same with and without canaries, as the relation requires.

`runs` independent fits on disjoint canary sets pool into one Steinke–Nasr–Jagielski audit (`bounds.one_run_audit`:
each canary is in exactly one fit, so the pooled mechanism is still (ε, δ)-DP for each canary); `mode="many-run"`
instead keeps one canary per fit, in or out, and bounds ε with Clopper–Pearson intervals (`bounds.many_run_audit`).

Broken variant "no-noise": the non-private reference method "als" is fitted while the ε of the configured private
method is reported, as a caller who mistook it for a private method would.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jdp.altmin import AltMinConfig, fit
from jdp.audit.bounds import RoutineAudit, many_run_audit, one_run_audit
from jdp.data import Interactions
from jdp.data.synthetic import planted_powerlaw

VARIANTS = ("honest", "no-noise")
MODES = ("one-run", "many-run")


def _canary_data(background: Interactions, canaries: int, items_per_canary: int, keep: np.ndarray,
                 rating: float, n_users: int, n_items: int) -> tuple[Interactions, np.ndarray]:
    """Background ratings plus the kept canaries; canary i is user n_bg_users + i rating items
    n_bg_items + i·k .. + k − 1. Returns the data and the canaries' item ids [canaries, k]."""
    n_bu, n_bi = background.n_users, background.n_items
    items = n_bi + np.arange(canaries * items_per_canary).reshape(canaries, items_per_canary)
    users = np.repeat(n_bu + np.arange(canaries), items_per_canary).reshape(canaries, items_per_canary)
    sel = keep.astype(bool)
    user = np.concatenate([background.user, users[sel].ravel()]).astype(np.int32)
    item = np.concatenate([background.item, items[sel].ravel()]).astype(np.int32)
    r = np.concatenate([background.rating, np.full(int(sel.sum()) * items_per_canary, rating, np.float32)])
    return Interactions(user=user, item=item, rating=r, n_users=n_users, n_items=n_items), items


def audit_altmin(cfg: AltMinConfig = AltMinConfig(method="ada-dpals", epsilon=2.0, budget=8, show_progress=False),
                 *, canaries: int = 100, items_per_canary: int = 8, runs: int = 1, mode: str = "one-run",
                 background_users: int = 300, background_items: int = 40, background_ratings: int = 3000,
                 variant: str = "honest", confidence: float = 0.95, seed: int) -> RoutineAudit:
    """Audits `fit(train, cfg)` with canary users (module docstring). `seed` (public) draws the background data,
    the inclusion bits and, offset per run, each fit's noise seed (a fixed seed is right here: the audit
    reproduces an experiment, it releases nothing)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if canaries < 1 or items_per_canary < 1 or runs < 1:
        raise ValueError("need canaries, items_per_canary and runs >= 1")
    if mode == "many-run" and runs < 4:
        raise ValueError("mode 'many-run' needs runs >= 4")
    rng = np.random.default_rng(seed)
    synth = planted_powerlaw(seed=seed, n_users=background_users, n_items=background_items, nnz=background_ratings,
                             rank=2, rating_scale=cfg.scale)
    bg = synth.data
    per_run = 1 if mode == "many-run" else canaries
    n_users = bg.n_users + per_run
    n_items = bg.n_items + per_run * items_per_canary
    run_cfg = cfg if variant == "honest" else dataclasses.replace(cfg, method="als", epsilon=None)
    scores, included, reported = [], [], None
    for r in range(runs):
        keep = (np.array([r % 2 == 0]) if mode == "many-run" else rng.random(per_run) < 0.5)
        data, items = _canary_data(bg, per_run, items_per_canary, keep, cfg.scale[1], n_users, n_items)
        model = fit(data, run_cfg, seed=seed * 1_000_003 + r)
        if reported is None:
            reported = (model.report.epsilon() if variant == "honest"
                        else fit(data, cfg, seed=seed * 1_000_003 + r).report.epsilon())
        scores.append(np.asarray(model.item_bias, np.float64)[items].sum(axis=1))
        included.append(keep)
    s, inc = np.concatenate(scores), np.concatenate(included)
    if mode == "many-run":
        result = many_run_audit(s[inc], s[~inc], cfg.delta, confidence, seed=seed)
    else:
        result = one_run_audit(s, inc, cfg.delta, confidence)
    setting = {"method": cfg.method, "epsilon_target": cfg.epsilon, "budget": cfg.budget, "mode": mode,
               "canaries_per_run": per_run, "items_per_canary": items_per_canary, "runs": runs,
               "background_users": bg.n_users, "background_items": bg.n_items, "background_ratings": bg.nnz}
    return RoutineAudit(f"altmin:{cfg.method} (canary users, {mode})", variant, float(reported), result, setting)


__all__ = ["MODES", "VARIANTS", "audit_altmin"]
