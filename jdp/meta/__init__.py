"""Task-level differentially private meta-learning (Zhou & Bassily, NeurIPS 2022).

Privacy unit throughout: one task's whole dataset. Algorithms: meta-NSGD (Alg. 1), private clustering
meta-learning with q meta-models (Alg. 2), DP-FTMRL (one pass, tree aggregation), plus local-training
and non-private references. Generic over a JAX per-example loss and parameter pytree.
"""
from jdp.meta.base_learner import RidgeLearner, SGDLearner, meta_gradient, squared_loss
from jdp.meta.baselines import local_training_risk, meta_sgd_nonprivate
from jdp.meta.clustering import private_clustering_meta, random_init, update_sensitivity
from jdp.meta.evaluate import per_task_risk, transfer_risk
from jdp.meta.ftmrl import dp_ftmrl, tree_prefix_noise
from jdp.meta.meta_nsgd import MetaResult, meta_nsgd
from jdp.meta.privacy import meta_sgd_event, theory_noise, tree_event
from jdp.meta.tasks import (TaskSet, authors_regression, cluster_centres, make_taskset, multi_cluster_regression,
                            single_cluster_regression)

__all__ = [
    "MetaResult", "RidgeLearner", "SGDLearner", "TaskSet", "authors_regression",
    "cluster_centres", "dp_ftmrl", "local_training_risk", "make_taskset",
    "meta_gradient", "meta_nsgd", "meta_sgd_event", "meta_sgd_nonprivate", "multi_cluster_regression",
    "per_task_risk", "private_clustering_meta", "random_init", "single_cluster_regression", "squared_loss",
    "theory_noise", "transfer_risk", "tree_event", "tree_prefix_noise", "update_sensitivity",
]
