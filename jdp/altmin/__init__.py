"""DP alternating minimization for recommendation: `fit(train, AltMinConfig(method=...))`.

Methods: 'als' (non-private reference), 'dpals-uniform', 'dpals-tail', 'ada-dpals', 'dpsgd-uniform',
'dpsgd-tail', 'ada-dpsgd'. See `jdp.altmin.model` for the privacy statement; `tune_private` picks the
configuration from a public grid privately (`jdp.altmin.tuning`).
"""
from jdp.altmin.model import (METHODS, AltMinConfig, AltMinModel, Method, UserEmbeddings, UserSolver, calibrate_noise,
                              candidate_event, fit, run_releases, solve_users, zero_cost_model)
from jdp.altmin.tuning import TunedModel, tune_private

__all__ = ["METHODS", "AltMinConfig", "AltMinModel", "Method", "TunedModel", "UserEmbeddings", "UserSolver",
           "calibrate_noise", "candidate_event", "fit", "run_releases", "solve_users", "tune_private", "zero_cost_model"]
