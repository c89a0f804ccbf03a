"""DP alternating minimization for matrix completion (Algorithm 3): ALS, DPALS, AdaDPALS, DPSGD, AdaDPSGD.

Model: r̂_ij = μ + b_j + c_i + u_j·v_i (`biases=False`: μ + u_j·v_i). Privacy unit: a user; neighbours
add or remove ALL ratings of one user (user-level DP). Only the item matrix V and the item biases c are
released (μ is a public prior unless `global_mean="private"`). Each step (a) solves every user's (u_j, b_j)
exactly from (V, c, μ) and the user's own ratings (billboard model: no privacy cost, nothing released)
and (b) updates [V, c] privately with task-weighted SSP (`dpals-*`, `ada-dpals`) or task-weighted noisy
GD (`dpsgd-*`, `ada-dpsgd`), using x_j = [clip(u_j, Γ), γ₀] as features (the constant γ₀ carries the
item bias, so ‖x_j‖ ≤ √(Γ² + γ₀²) enters the sensitivity) and the clipped residuals r − μ − b_j
(|y| ≤ Γy) as labels. Graceful degradation is a property of the defaults: the rank comes from the
public sizes and σ (`default_dim`: 0, biases only, when one direction's signal-to-noise is below 4) and
the item ridge grows with the noise (`item_ridge`), so as ε shrinks the released c shrinks to 0 and
the model tends to the zero-cost one (prior + each user's own bias, `zero_cost_model`). Budget
allocation across a user's items: uniform sampling of k items, tail-biased sampling of the k items with
the smallest private counts, or adaptive weights n̂_i^(−μ) clipped per user to Σ_i w_ij² ≤ k (ω_i = 1
without counts when they would be of no use, `counts_useful`). The noisy-GD item update caps each item's
step by its released count; `dpsgd-uniform` releases counts for those caps by the same rule, so that every
allocation's step sizes see the same information. At rank 0 every step's Gram is the same
weighted count, released once (`_gram_released_once`). Pre-processing (private item counts, private
global mean) is accounted too: the PrivacyReport lists every release and composes them with dp_accounting.

`als` is the NON-PRIVATE reference (exact mean, no noise, all ratings): never a default.

Assumed public (recorded in the PrivacyReport's `assumptions`): the rating scale, and the sizes
`train.n_users` (a public bound on the number of users: the user id space) and `train.n_items` (the
item catalogue: the rows of the released V). These are the Interactions' DECLARED sizes, never
counts of the users / items present in the rows; the default dim, the n of the adaptive weights
(eq. 16), the noisy-GD normaliser q·n and the shape of V depend on them and on ε, δ and the config
only, so adding or removing one user changes none of them. One observation per (user, item) is
assumed: duplicate pairs raise ValueError unless `merge_duplicates=True` merges them (mean rating)
before anything private runs.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jdp.accounting import ADD_OR_REMOVE_ONE, PrivacyReport
from jdp.altmin.config import AltMinConfig
from jdp.altmin.plan import NoiseMultipliers, RunPlan, mean_bounds, plan_run, released_ratings_per_user
from jdp.altmin.updates import ITEM_UPDATES, allocation_weights, item_update_features
from jdp.altmin.users import UserEmbeddings, UserSolver, residuals
from jdp.data import Interactions, check_unique_pairs
from jdp.multitask.counts import private_mean, private_total_count
from jdp.multitask.ssp import clip_label_norms
from jdp.noise import seeded_key, standard_normal


@dataclasses.dataclass
class AltMinModel:
    """The released item matrix V, item biases c (+ the public or released μ) and how they were obtained."""
    item_factors: np.ndarray   # [n_items, d]
    item_bias: np.ndarray      # [n_items] (zeros without biases)
    mean: float
    config: AltMinConfig
    report: PrivacyReport
    noise_multiplier: float | None
    timings: dict
    seed: int | None = None  # the noise seed: reproduces the run; as secret as the data

    def user_factors(self, history: Interactions) -> UserEmbeddings:
        """Each user's embedding, bias and item-bias scale solved from the release and the user's own ratings
        (no privacy cost)."""
        return UserSolver.for_config(history, self.config, predict=True)(self.item_factors, self.item_bias, self.mean)

    def predict(self, users: UserEmbeddings, user: np.ndarray, item: np.ndarray) -> np.ndarray:
        lo, hi = self.config.rating_range
        item_bias = self.item_bias[item] * (1.0 if users.slope is None else users.slope[user])
        pred = (self.mean + users.bias[user] + item_bias
                + np.einsum("nd,nd->n", users.factors[user], self.item_factors[item]))
        return np.clip(pred, lo, hi)


def zero_cost_model(train: Interactions, cfg: AltMinConfig) -> AltMinModel:
    """The model every user gets for free: the public prior μ plus the user's own bias, solved on the user's
    side; nothing is released (empty report, ε = 0). A private model should never do worse."""
    cfg = cfg.for_data(train)
    prior = cfg.global_mean if not isinstance(cfg.global_mean, (str, type(None))) else "prior"  # a declared prior
    # the user-side defaults only: same baseline for every config. With no released item biases the user's scale
    # column is zero, a_j = 1 and b_j is the plain ridge bias; kept so that the solve shares the compiled program
    # of a rank-0 model's predictions on the same ratings
    cfg = AltMinConfig(dim=0, rating_range=cfg.rating_range, global_mean=prior, delta=cfg.delta,
                       show_progress=False).resolve()
    report = PrivacyReport(cfg.delta, unit="user", relation=ADD_OR_REMOVE_ONE)
    report.assume(f"public rating scale {tuple(cfg.rating_range)}; nothing released")
    return AltMinModel(np.zeros((train.n_items, 0), np.float32), np.zeros(train.n_items, np.float32),
                       prior_mean(cfg), cfg, report, None, {}, None)


def prior_mean(cfg: AltMinConfig) -> float:
    lo, hi = cfg.rating_range
    return float(cfg.global_mean) if not isinstance(cfg.global_mean, str) else 0.5 * (lo + hi)


def fit(train: Interactions, cfg: AltMinConfig, seed: int | None = None) -> AltMinModel:
    """Trains with `cfg.method` on `train` and returns the released item matrix and biases and the PrivacyReport.

    Unit: a user; relation: add/remove all ratings of one user. `train.n_users` / `train.n_items` are
    used as PUBLIC sizes (user id space, item catalogue; see the module docstring) and recorded as
    assumptions in the report. Duplicate (user, item) rows raise ValueError, for every method, unless
    `cfg.merge_duplicates` (then they are merged into their mean rating first).
    `seed` seeds every noise draw; None (the default) draws fresh OS entropy, recorded in `model.seed`.
    Pass a seed only to reproduce an experiment: whoever knows it can subtract the noise.
    Private tuning of the ridge / budget: `jdp.altmin.tuning.fit_tuned`.
    """
    cfg = cfg.for_data(train)
    resolved = cfg.resolve(train.n_users)  # every field and the privacy rule, once, before any work
    train = _checked_ratings(train, resolved)
    timings = {}
    t0 = time.perf_counter()
    key, seed = seeded_key(seed)
    k_mean, k_counts, k_weights, k_init, k_train, k_gram = jax.random.split(key, 6)
    report = _report(train, cfg)

    # Everything private is fixed before any rating is read (the resolved config, the noise multipliers, the
    # releases), except the rank check's choice among plans that all spend the same Gaussian budget
    # (`plan_run`). The report lists exactly the releases the calibration composed.
    plan = _final_plan(train, cfg, resolved, key, timings)
    cfg, noise = plan.config, plan.noise
    for release in plan.releases:
        report.add_release(release)
    if cfg.parsed_method.optional_counts and not cfg.releases_counts:
        report.assume("adaptive weights without item counts (counts_useful: of no use at this noise): ω_i = 1"
                      if cfg.parsed_method.allocation == "adaptive" else
                      "noisy-GD step caps without item counts (counts_useful: of no use at this noise)")

    # Pre-processing: the global mean μ and the budget allocation (weights with Σ_i w_ij² ≤ k per user).
    mean = _global_mean(train, cfg, noise, k_mean, report)
    weights, counts = allocation_weights(train, cfg, noise, k_counts, k_weights)
    timings["preprocess_seconds"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    item_update = ITEM_UPDATES[cfg.parsed_method.rule](train, weights, cfg, noise, timings, counts, gram_key=k_gram)
    timings["plan_seconds"] = time.perf_counter() - t1
    v, c = _alternate(train, cfg, mean, item_update, k_init, k_train, timings)
    timings["train_seconds"] = time.perf_counter() - t0
    sigma = None if noise is None else noise.training
    return AltMinModel(np.asarray(v), np.asarray(c), float(mean), cfg, report, sigma, timings, seed)


def checked_config(train: Interactions, cfg: AltMinConfig) -> AltMinConfig:
    """`cfg` for `train` (`for_data`), validated before any work: every field (`resolve`) and, for a private
    method, the one privacy rule (jdp.validation.check_privacy, in `resolve`): δ < 1/n of the declared public user
    id space."""
    cfg = cfg.for_data(train)
    cfg.resolve(train.n_users)
    return cfg


def _report(train: Interactions, cfg: AltMinConfig) -> PrivacyReport:
    """The run's report with its public assumptions (the releases are added from the plan)."""
    report = PrivacyReport(cfg.delta, unit="user", relation=ADD_OR_REMOVE_ONE)
    report.assume(f"public sizes declared by the caller: n_users={train.n_users} (user id space, a bound on the "
                  f"number of users), n_items={train.n_items} (item catalogue); not counted from the ratings")
    report.assume(f"public rating scale {tuple(cfg.rating_range)}")
    if cfg.merge_duplicates:
        report.assume("duplicate (user, item) ratings merged into their mean per user before training")
    return report


def _final_plan(train: Interactions, cfg: AltMinConfig, resolved: AltMinConfig, key: jax.Array,
                timings: dict) -> RunPlan:
    """`plan_run` on the declared sizes; when it plans the rank check, the users' sizes are released (the first
    release of the plan) and the run re-planned with their value (`resolved`: `cfg.resolve()`, validated)."""
    n_users, n_items = train.n_users, train.n_items
    plan = plan_run(cfg, n_users, n_items, resolved=resolved)
    if plan.noise is not None and plan.noise.size is not None:  # the rank check: release the users' sizes, re-plan
        total = private_total_count(jax.random.fold_in(key, 7), jnp.asarray(train.user), n_users, cfg.budget,
                                    plan.noise.size)
        per_user = released_ratings_per_user(total, n_users, cfg, plan.noise.size)
        plan = plan_run(cfg, n_users, n_items, released_ratings_per_user=per_user, resolved=resolved)
        timings["released_ratings_per_user"] = per_user
    return plan


def _alternate(train: Interactions, cfg: AltMinConfig, mean: float, item_update, k_init: jax.Array,
               k_train: jax.Array, timings: dict) -> tuple[jax.Array, jax.Array]:
    """Alternating minimization: (V [n_items, d], c [n_items]) after cfg.steps steps. Item side: tasks = items,
    features x_j = [clip(u_j, Γ), γ₀] of the users (‖x_j‖ ≤ item_feature_bound), labels
    y_ij = clip(r_ij − μ − b_j, Γy), θ_i = [v_i, c_i / γ₀]."""
    n_users, n_items, d = train.n_users, train.n_items, cfg.dim
    v = cfg.init_scale * standard_normal(k_init, (n_items, d))
    c = jnp.zeros(n_items, jnp.float32)
    user_solver = UserSolver.for_config(train, cfg)
    user, rating = jnp.asarray(train.user), jnp.asarray(train.rating, jnp.float32)
    step_seconds = []
    for t in tqdm(range(cfg.steps), desc=f"{cfg.method}", disable=not cfg.show_progress, leave=False):
        ts = time.perf_counter()
        users = user_solver(v, c, mean)  # each user's exact solve from the release and own ratings: free
        feats = item_update_features(users.factors, cfg)
        labels = residuals(rating, user, users.bias, mean, cfg.label_clip if cfg.private else math.inf)
        if cfg.label_norm is not None:  # SSP: each user's weighted labels bounded in norm (per-user transformation)
            labels = clip_label_norms(user, item_update.weights, labels, n_users, cfg.label_norm)
        theta = item_update(v, c, feats, labels, jax.random.fold_in(k_train, t))
        v = theta[:, :d]
        if cfg.biases:
            c = cfg.bias_clip * theta[:, d]
        if cfg.rescale_items and d > 0:
            v = v / jnp.maximum(jnp.mean(jnp.linalg.norm(v, axis=1)), 1e-12)
        v = jax.block_until_ready(v)
        step_seconds.append(time.perf_counter() - ts)
    timings["step_seconds"] = step_seconds
    return v, c


def _checked_ratings(train: Interactions, cfg: AltMinConfig) -> Interactions:
    """`train` with one rating per (user, item) (duplicates merged when cfg.merge_duplicates, else ValueError)
    and every rating inside the declared scale."""
    if train.nnz == 0:
        raise ValueError("train has no ratings")
    if cfg.merge_duplicates:
        train = train.merge_duplicates()  # per-user transformation of the user's own rows: no privacy cost
    else:
        check_unique_pairs(train.user, train.item, ("user", "item"), "fit: train",
                           "AltMinConfig(merge_duplicates=True) merges each pair into its mean rating")
    lo, hi = cfg.rating_range
    if train.rating.min() < lo or train.rating.max() > hi:
        raise ValueError(f"ratings must lie in the declared rating_range {cfg.rating_range}")
    return train


def _global_mean(train: Interactions, cfg: AltMinConfig, noise: NoiseMultipliers | None, key: jax.Array,
                 report: PrivacyReport) -> float:
    """μ: the exact mean ('als'), a private estimate (its releases are in the plan) or a public prior."""
    if cfg.global_mean == "exact":
        return float(train.rating.mean())
    if cfg.global_mean == "private":
        mid, half = mean_bounds(cfg)
        return mid + private_mean(key, jnp.asarray(train.user), jnp.asarray(train.rating - mid), half, cfg.budget,
                                  noise.mean)
    mean = prior_mean(cfg)
    report.assume(f"global mean = public prior {mean:g} (no ε spent)")
    return mean
