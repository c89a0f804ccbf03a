"""Compatibility names: `jdp.altmin.model` was split into `config`, `plan`, `users`, `updates` and `train`
(the module docstring of `jdp.altmin.train` is the family's privacy statement). Old imports keep working;
new code imports from `jdp.altmin` or from the module that defines the name. Patch a name where it is used
(e.g. `jdp.altmin.updates.private_counts`), not here."""
from jdp.altmin import fit
from jdp.altmin.config import (ALLOCATIONS, DEFAULT_RATING_RANGE, METHODS, NOISY_GD, RIDGE, AltMinConfig, Method,
                               default_label_norm)
from jdp.altmin.plan import (COUNT_UCB, KEPT_COUNTS, MIN_DIRECTION_SNR, POPULARITY_MIN_LOG_RANGE, SGD_STEP,
                             NoiseMultipliers, RunPlan, adaptive_item_weights, bias_gram_noise_ratio, calibrate_noise,
                             candidate_event, counts_resolvable, counts_useful, default_dim, item_bias_prior,
                             item_bias_prior_mean, item_ridge, item_step_sizes, plan_run, released_ratings_per_user,
                             run_releases)
from jdp.altmin.train import AltMinModel, zero_cost_model
from jdp.altmin.tuning import TUNE_SPLIT_SEED, TUNE_VALID_FRACTION
from jdp.altmin.updates import ITEM_UPDATES, item_update_features
from jdp.altmin.users import SMALL_SOLVE_FEATURES, USERS_PER_BLOCK, UserEmbeddings, UserSolver, solve_users

__all__ = ["ALLOCATIONS", "COUNT_UCB", "DEFAULT_RATING_RANGE", "ITEM_UPDATES", "KEPT_COUNTS", "METHODS",
           "MIN_DIRECTION_SNR", "NOISY_GD", "POPULARITY_MIN_LOG_RANGE", "RIDGE", "SGD_STEP", "SMALL_SOLVE_FEATURES",
           "TUNE_SPLIT_SEED", "TUNE_VALID_FRACTION", "USERS_PER_BLOCK", "AltMinConfig", "AltMinModel", "Method",
           "NoiseMultipliers", "RunPlan", "UserEmbeddings", "UserSolver", "adaptive_item_weights",
           "bias_gram_noise_ratio", "calibrate_noise", "candidate_event", "counts_resolvable", "counts_useful",
           "default_dim", "default_label_norm", "fit", "item_bias_prior", "item_bias_prior_mean", "item_ridge",
           "item_step_sizes", "item_update_features", "plan_run", "released_ratings_per_user", "run_releases",
           "solve_users", "zero_cost_model"]
