"""Multi-task user-level DP under task skew (Krichene et al., ICML 2023).

- `weights`: adaptive per-task weights (eq. 16) with per-user clipping (eq. 12) or normalisation, and
  the uniform / tail-biased sampling baselines expressed as weights.
- `counts`: private task counts and private centering.
- `ssp`: task-weighted sufficient-statistics perturbation (Algorithm 1), sharded over devices.
- `noisy_gd`: task-weighted noisy gradient descent (Algorithm 2).
- `gram`: the bucketed per-task Gram engine both build on.
"""
from jdp.multitask.counts import PrivateCounts, private_counts, private_label_sum, private_mean
from jdp.multitask.noisy_gd import NoisyGDConfig, task_weighted_noisy_gd
from jdp.multitask.ssp import task_weighted_ssp
from jdp.multitask.weights import (adaptive_weights, clip_user_weights, normalize_user_weights, tail_sampling_weights,
                                   task_weights, uniform_sampling_weights)

__all__ = ["NoisyGDConfig", "PrivateCounts", "adaptive_weights", "clip_user_weights", "normalize_user_weights",
           "private_counts", "private_label_sum", "private_mean", "tail_sampling_weights", "task_weighted_noisy_gd", "task_weighted_ssp",
           "task_weights", "uniform_sampling_weights"]
