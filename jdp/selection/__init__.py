"""Private selection with heterogeneous sensitivities (RNM, EM, PF, kRR, RS_γ, GEM, mGEM, combined GEM).

Every mechanism is a pure function `(key, scores, sensitivities, epsilon, ...) -> index` that jit-compiles
and vmaps; `select` runs one over a batch, `probabilities` gives exact output probabilities and each
private mechanism exposes `dp_event(epsilon)`. RNMH is not DP and lives only under "rnmh-nonprivate".
"""
from jdp.selection.baselines import krr, rnmh_nonprivate, uniform
from jdp.selection.correlation import (pearson, recommend_mechanism_nonprivate, spearman,
                                       weighted_correlation)
from jdp.selection.generalized_em import combined_gem, gem, gem_scores, mgem
from jdp.selection.random_stop import random_stopping
from jdp.selection.batched import select
from jdp.selection.registry import (NONPRIVATE_REFERENCES, PRIVATE_MECHANISMS, Mechanism, get_mechanism,
                                    privacy_report, probabilities)
from jdp.selection.tuning import select_configuration
from jdp.selection.rnm import exponential_mechanism, permute_and_flip, rnm_exponential, rnm_gumbel, rnm_laplace

__all__ = [
    "Mechanism", "NONPRIVATE_REFERENCES", "PRIVATE_MECHANISMS", "combined_gem", "exponential_mechanism", "gem",
    "gem_scores", "get_mechanism", "krr", "mgem", "pearson", "permute_and_flip", "privacy_report",
    "probabilities", "random_stopping", "recommend_mechanism_nonprivate", "rnm_exponential", "rnm_gumbel",
    "rnm_laplace", "rnmh_nonprivate", "select", "select_configuration", "spearman", "uniform", "weighted_correlation",
]
