"""The item side of alternating minimization: how a user's budget k is spread over the user's ratings
(`allocation_weights`) and the private item update, one class per update rule picked from `ITEM_UPDATES`.

An item update is built once per fit, `update(train, weights, cfg, noise, timings, counts, gram_key=...)`, and
called once per step, `update(v, c, feats, labels, key) -> θ [n_items, d (+1 with biases)]`, θ_i = [v_i, c_i / γ₀].
It draws each release's noise at the scale `jdp.altmin.plan.run_releases` recorded for it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.altmin.config import NOISY_GD, RIDGE, AltMinConfig, bias_priors
from jdp.altmin.plan import (KEPT_COUNTS, NoiseMultipliers, adaptive_item_weights, gram_released_once, item_bias_prior,
                             item_bias_prior_mean, item_ridge, item_step_sizes, item_update_releases, noisy_gd_config,
                             releases_kept_counts)
from jdp.altmin.users import take_rows
from jdp.data import Interactions
from jdp.multitask import gram, noisy_gd
from jdp.multitask.counts import private_counts
from jdp.multitask.ssp import check_user_budget, count_posterior_mean, solve_tasks, task_mesh
from jdp.multitask.weights import adaptive_weights, tail_sampling_weights, uniform_sampling_weights
from jdp.noise import clip_by_norm


def allocation_weights(train: Interactions, cfg: AltMinConfig, noise: NoiseMultipliers | None,
                        k_counts: jax.Array, k_weights: jax.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """(each rating's weight in the item update, the released item counts or None). Private methods keep
    Σ_i w_ij² ≤ k for every user (checked). Tail sampling and adaptive weights read the private item counts
    when `cfg.releases_counts` (their release is in the plan). dpsgd-tail returns the released counts of the
    ratings its sample kept (`releases_kept_counts`) for its step caps."""
    method, k = cfg.parsed_method, cfg.budget
    if not method.private:
        return np.ones(train.nnz, np.float32), None
    user, item = jnp.asarray(train.user), jnp.asarray(train.item)
    counts = private_counts(k_counts, user, item, train.n_items, k, noise.counts).counts if cfg.releases_counts else None
    if method.allocation == "uniform":
        weights = uniform_sampling_weights(k_weights, user, k)
    elif method.allocation == "tail":
        weights = tail_sampling_weights(k_weights, user, item, counts, k)
        if releases_kept_counts(cfg):  # the kept ratings: ≤ k distinct items per user, sensitivity √k as above
            kept = np.asarray(weights) > 0
            counts = private_counts(jax.random.fold_in(k_counts, 1), user[kept], item[kept], train.n_items, k,
                                    noise.counts, name=KEPT_COUNTS).counts
    else:  # without counts: ω_i = 1; noisy GD reads them through their posterior (`_weight_counts`)
        weights = adaptive_weights(_weight_counts(counts, cfg, noise, train), user, item, train.n_users, float(k),
                                   cfg.mu, cfg.weight_mode, n_tasks=train.n_items)
    weights = np.asarray(weights)
    check_user_budget(train.user, weights, train.n_users, float(k))
    return weights, None if counts is None else np.asarray(counts)


def _weight_counts(counts, cfg: AltMinConfig, noise: NoiseMultipliers | None, train: Interactions):
    """The counts the adaptive weights ω_i = n_i^(−μ) read. SSP: the released counts (it releases them only for the
    weights, when `counts_useful` or the caller forces it). Noisy GD, which may release them for its step caps
    alone at a noise far above the counts: the effective counts (E[n^(−μ) | n̂])^(−1/μ) under the public
    scale-free prior up to n_users (`count_posterior_mean`; post-processing), so noisy counts steer the weights
    only as far as they are informative (the plug-in n̂ where the noise is small). On ML-100K at ε = 5 (count noise
    1.2× the mean count; 5 seeds) ada-dpsgd reached test RMSE 0.9642 and 1.124 on the tail buckets 0-1 with them,
    0.9651 / 1.143 with ω_i = 1 and 0.9672 / 1.133 with the plug-in counts."""
    if counts is None or cfg.parsed_method.rule != NOISY_GD or cfg.mu == 0:
        return counts
    mu, std = float(cfg.mu), float(noise.counts) * math.sqrt(cfg.budget)
    moment = count_posterior_mean(jnp.asarray(counts, jnp.float32), std, float(train.n_users), lambda n: n ** (-mu))
    return np.asarray(moment, np.float64) ** (-1.0 / mu)


def item_update_features(user_factors: jax.Array, cfg: AltMinConfig) -> jax.Array:
    """x_j = [clip(u_j, Γ), γ₀] (private; unclipped for 'als'): ‖x_j‖ ≤ cfg.item_feature_bound, the bound the
    SSP / noisy-GD sensitivity analysis uses. Rank 0 keeps only γ₀; no biases drop it."""
    u = jnp.asarray(user_factors, jnp.float32)
    feats = clip_by_norm(u, cfg.user_clip) if cfg.private else u
    if cfg.biases:
        feats = jnp.concatenate([feats, jnp.full((u.shape[0], 1), cfg.bias_clip, jnp.float32)], axis=1)
    return feats


class _RidgeItemUpdate:
    """Item update by one ridge solve per item of its statistics A_i = Σ_j w_ij x_j x_jᵀ, b_i = Σ_j w_ij y_ij x_j:
    perturbed at the SSP release's noise scales when private (`dpals-*`, `ada-dpals`), exact for 'als'. The
    observation layout is built once; items are sharded across devices (`cfg.n_shards`)."""

    def __init__(self, train: Interactions, weights: np.ndarray, cfg: AltMinConfig, noise: NoiseMultipliers | None,
                 timings: dict, counts: np.ndarray | None = None, gram_key: jax.Array | None = None):
        self.cfg, self.timings = cfg, timings
        # rank 0: A is released once (`gram_released_once`): every step draws A's noise from gram_key
        self.gram_key = gram_key if gram_released_once(cfg) else None
        self.released_count = None  # the first step's released Â (rank 0: the whole Gram), checked at later steps
        self.weights = jnp.asarray(weights, jnp.float32)
        self.mesh = task_mesh(cfg.n_shards)
        plan = gram.build_plan(train.item, train.user, weights, train.n_items,
                               n_shards=1 if self.mesh is None else self.mesh.size)
        self.classes, self.stack_index = gram.device_arrays(plan)
        self.obs_index, self.class_tasks = gram.observation_index(plan), gram.class_tasks(plan)
        self.flat_index = jnp.asarray(plan.flat_index)
        # the prior mean of the bias coordinate, 0 until an empirical-Bayes prior is centred elsewhere: always an
        # array, so every solve of a fit is ONE compiled program (None then an array compiled it twice, ~1.1 s)
        self.zero_prior = np.zeros(plan.n_tasks, np.float32)
        if cfg.private:
            self.sigma = noise.training
            release_a, release_b = item_update_releases(cfg, self.sigma)  # the noise drawn is the noise recorded
            self.std_a, self.std_b = release_a.noise_scale, release_b.noise_scale
            self.n_users = train.n_users
            self.lam, self.count_ridge = ((cfg.reg, None) if cfg.reg is not None
                                          else item_ridge(cfg, self.sigma, self.n_users))
        else:
            self.sigma, self.std_a, self.std_b = None, 0.0, 0.0
            self.lam = cfg.reg if cfg.reg is not None else cfg.user_reg
            self.count_ridge = None
            if cfg.reg_per_rating and cfg.biases:  # ALS-WR: ridge λ·n_i, n_i read off the γ₀ column
                self.count_ridge = np.array([0.0, 0.0, self.lam, cfg.bias_clip**2, 0.0, 1.0], np.float32)
                self.lam = 1e-6
        # private, default ridge, with biases: the item-bias prior is re-estimated from each release
        self.empirical_bayes = cfg.private and self.count_ridge is not None

    def __call__(self, v: jax.Array, c: jax.Array, feats: jax.Array, labels: jax.Array, key: jax.Array) -> jax.Array:
        classes = gram.with_labels(self.classes, self.obs_index, labels)
        theta = self._solve(feats, classes, key)
        if not self._with_stats:
            return take_rows(theta, self.flat_index)
        stats = np.asarray(take_rows(theta, self.flat_index))[:, -2:]
        if self.gram_key is not None:  # A released once: every step must see the first step's noisy Â bit for bit
            if self.released_count is None:
                self.released_count = stats[:, 0].copy()
            elif not np.array_equal(stats[:, 0], self.released_count):
                raise RuntimeError("the rank-0 Gram changed between steps: its single release would not cover it")
        if not self.empirical_bayes:
            return take_rows(theta, self.flat_index)[:, :-2]
        # empirical-Bayes prior from this release's bias statistics, then the same release (same key, same
        # noise) solved again with it: post-processing. The ridge carries over to the next step's first solve.
        if self.cfg.item_bias_mean == "popularity" and self.cfg.dim == 0:
            mean, tau2 = item_bias_prior_mean(stats[:, 0], stats[:, 1], self.cfg, self.sigma, self.n_users)
        else:
            mean, tau2 = None, item_bias_prior(stats[:, 0], stats[:, 1], self.cfg, self.sigma)
        if self.cfg.dim > 0:  # one scalar ridge per item also shrinks its factors: never below the public prior's
            tau2 = max(tau2, bias_priors(self.cfg)[1])
        self.lam, self.count_ridge = item_ridge(self.cfg, self.sigma, self.n_users, tau2)
        theta = self._solve(feats, classes, key, None if mean is None else mean / self.cfg.bias_clip)
        self.timings.setdefault("item_bias_prior_std", []).append(math.sqrt(tau2))
        if mean is not None:
            self.timings.setdefault("item_bias_prior_mean_range", []).append([float(mean.min()), float(mean.max())])
        return take_rows(theta, self.flat_index)[:, :-2]  # without the two statistics columns

    @property
    def _with_stats(self) -> bool:
        return self.empirical_bayes or self.gram_key is not None

    def _solve(self, feats: jax.Array, classes, key: jax.Array, prior_last: np.ndarray | None = None) -> jax.Array:
        return solve_tasks(feats, classes, self.class_tasks, self.stack_index, key, self.std_a, self.std_b, self.lam,
                           mesh=self.mesh, noisy=self.cfg.private, count_ridge=self.count_ridge,
                           bias_stats=self._with_stats, gram_key=self.gram_key,
                           prior_last=self.zero_prior if prior_last is None else prior_last)


class _NoisyGDItemUpdate:
    """Item update by `sgd_inner_steps` task-weighted noisy GD steps (`dpsgd-*`, `ada-dpsgd`) from the current
    θ_i = [v_i, c_i / γ₀]; every user's total gradient is clipped to `l2_clip`."""

    def __init__(self, train: Interactions, weights: np.ndarray, cfg: AltMinConfig, noise: NoiseMultipliers,
                 timings: dict, counts: np.ndarray | None = None, gram_key: jax.Array | None = None):
        self.cfg, self.sgd = cfg, noisy_gd_config(cfg, noise.training)  # gram_key: unused (no Gram released)
        self.item, self.user, self.weights = jnp.asarray(train.item), jnp.asarray(train.user), jnp.asarray(weights)
        self.n_items, self.n_users = train.n_items, train.n_users
        self.task_lr = None
        if cfg.sgd_lr is None:
            weight_counts = _weight_counts(counts, cfg, noise, train)
            omega = (adaptive_item_weights(weight_counts, cfg, train.n_users)
                     if cfg.parsed_method.allocation == "adaptive" and weight_counts is not None else None)
            self.task_lr = item_step_sizes(cfg, noise, counts, train.n_users, train.n_items, omega)

    def __call__(self, v: jax.Array, c: jax.Array, feats: jax.Array, labels: jax.Array, key: jax.Array) -> jax.Array:
        init = jnp.concatenate([v, (c / self.cfg.bias_clip)[:, None]], axis=1) if self.cfg.biases else v
        return noisy_gd.run(key, init, self.item, self.user, feats[self.user], labels, self.weights, self.sgd,
                            n_tasks=self.n_items, n_users=self.n_users, task_lr=self.task_lr)



ITEM_UPDATES = {RIDGE: _RidgeItemUpdate, NOISY_GD: _NoisyGDItemUpdate}  # Method.rule -> its item update class
