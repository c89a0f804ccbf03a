"""DP alternating minimization for recommendation: `fit(train, AltMinConfig(method=...))`.

Methods: 'als' (non-private reference), 'dpals-uniform', 'dpals-tail', 'ada-dpals', 'dpsgd-uniform',
'dpsgd-tail', 'ada-dpsgd'. Modules, in the order a run uses them: `config` (the method table and
`AltMinConfig`), `plan` (releases, calibration, public defaults, `plan_run`), `users` (the free user-side
solves), `updates` (budget allocation and the private item update, one class per rule), `train` (`fit`, the
loop, and the privacy statement); `tuning` picks a configuration from a public grid privately (`fit_tuned`,
`tune_private`).
"""
from __future__ import annotations

import warnings

from jdp.altmin import train as _train
from jdp.altmin.config import METHODS, AltMinConfig, Method
from jdp.altmin.plan import calibrate_noise, candidate_event, run_releases
from jdp.altmin.train import AltMinModel, zero_cost_model
from jdp.altmin.tuning import TunedModel, fit_tuned, tune_private
from jdp.altmin.users import UserEmbeddings, UserSolver, solve_users


def fit(train, cfg: AltMinConfig, seed: int | None = None, *, tune: str | None = None, valid=None) -> AltMinModel:
    """`jdp.altmin.train.fit`. `tune="private"` is deprecated (kept one release): call `fit_tuned(train, cfg,
    seed, valid)` instead."""
    if tune is None:
        return _train.fit(train, cfg, seed)
    warnings.warn("fit(tune='private') is deprecated: call jdp.altmin.fit_tuned(train, cfg, seed, valid)",
                  DeprecationWarning, stacklevel=2)
    _train.checked_config(train, cfg)  # the config first, as before
    if tune != "private":
        raise ValueError(f"tune must be None or 'private', got {tune!r}")
    return fit_tuned(train, cfg, seed, valid)


__all__ = ["METHODS", "AltMinConfig", "AltMinModel", "Method", "TunedModel", "UserEmbeddings", "UserSolver",
           "calibrate_noise", "candidate_event", "fit", "fit_tuned", "run_releases", "solve_users", "tune_private",
           "zero_cost_model"]
