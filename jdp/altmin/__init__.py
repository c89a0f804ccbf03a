"""DP alternating minimization for recommendation: `fit(train, AltMinConfig(method=...))`.

Methods: 'als' (non-private reference), 'dpals-uniform', 'dpals-tail', 'ada-dpals', 'dpsgd-uniform',
'dpsgd-tail', 'ada-dpsgd'. See `jdp.altmin.model` for the privacy statement.
"""
from jdp.altmin.model import METHODS, AltMinConfig, AltMinModel, UserSolver, calibrate_noise, evaluate_ratings, fit, solve_users

__all__ = ["METHODS", "AltMinConfig", "AltMinModel", "UserSolver", "calibrate_noise", "evaluate_ratings", "fit", "solve_users"]
