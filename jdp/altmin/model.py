"""DP alternating minimization for matrix completion (Algorithm 3): ALS, DPALS, AdaDPALS, DPSGD, AdaDPSGD.

Privacy unit: a user; neighbours add or remove ALL ratings of one user (user-level DP). Only the item
matrix V is released. Each step (a) solves every user's embedding exactly from V and the user's own
ratings (billboard model: no privacy cost, nothing released) and (b) updates V privately with
task-weighted SSP (`dpals-*`, `ada-dpals`) or task-weighted noisy GD (`dpsgd-*`, `ada-dpsgd`),
using the clipped user embeddings (‖u‖ ≤ Γ) as features and clipped centred ratings (|r| ≤ Γy) as
labels. Budget allocation across a user's items: uniform sampling of k items, tail-biased sampling
of the k items with the smallest private counts, or adaptive weights n̂_i^(−μ) clipped per user to
Σ_i w_ij² ≤ k. Pre-processing (private item counts, private global mean) is accounted too: the
PrivacyReport lists every release and composes them with dp_accounting.

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

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jdp.accounting import PrivacyReport, calibrate, check_delta, check_epsilon, check_positive
from jdp.data import Interactions, check_unique_pairs
from jdp.multitask import gram
from jdp.multitask.counts import private_counts, private_mean
from jdp.multitask.noisy_gd import NoisyGDConfig, _run as _noisy_gd_run, record_noisy_gd_releases
from jdp.multitask.ssp import check_user_budget, record_ssp_releases, solve_tasks, task_mesh
from jdp.multitask.weights import adaptive_weights, tail_sampling_weights, uniform_sampling_weights
from jdp.noise import clip_by_norm, seeded_key

METHODS = ("als", "dpals-uniform", "dpals-tail", "ada-dpals", "dpsgd-uniform", "dpsgd-tail", "ada-dpsgd")
USERS_PER_BLOCK = 16384  # user solves run in blocks of this many users to bound memory (A is d×d per user)


@dataclasses.dataclass(frozen=True)
class AltMinConfig:
    """Hyper-parameters. `None` fields take the documented defaults in `resolve()`, which depend only on
    public quantities (ε, δ, dim, the id-space sizes), never on the ratings."""
    method: str = "ada-dpals"
    epsilon: float | None = 1.0          # None for 'als'
    delta: float = 1e-5
    dim: int | None = None               # default: default_dim() from the public sizes and the calibrated
                                         # noise (2 … 32); 32 for ALS
    steps: int | None = None             # 2 (ε≤2), 3 (ε≤10), 4 otherwise; ALS 10
    mu: float = 0.25                     # adaptive exponent (ada-*)
    budget: int = 100                    # k: per-user squared-weight budget β = k; also count_sample
    weight_mode: str = "clip"            # 'clip' (paper, eq. 12) or 'normalize' (reference code)
    user_clip: float = 0.5               # Γ: ‖u_j‖ clip for features. λ and the noise scale with Γ², so only
                                         # the share of users clipped matters: with V at mean row norm 1 most
                                         # users exceed 0.5 and land on the sphere, which gives the most signal
                                         # per unit of sensitivity (measured: never worse than 1.0, 1% better
                                         # RMSE at ε = 1 on the ML10M-scale synthetic)
    label_clip: float | None = None      # Γy on centred ratings; default half the rating range
    rating_range: tuple[float, float] = (0.5, 5.0)  # PUBLIC rating scale
    center: bool = True                  # private global mean (non-private exact mean for 'als')
    reg: float | None = None             # item ridge λ; default noise-aware: reg_scale·2√d·std(A noise)
    reg_scale: float = 2.0
    user_reg: float | None = None        # user ridge; default 1.0 (private) / 5.0 (als)
    count_fraction: float = 0.12         # ε share that sets the noise of the private item counts
    center_fraction: float = 0.03        # ε share that sets the noise of the private mean (very insensitive)
    sgd_inner_steps: int = 4             # noisy GD updates per outer step (dpsgd-*)
    sgd_clip: float = 1.0                # per-user gradient clip C (dpsgd-*)
    sgd_lr: float | None = None          # default 0.5; each noisy-GD update divides the summed gradient by
                                         # q·n_users (n_users: the declared public size)
    sample_rate: float = 1.0             # Poisson rate of users per noisy GD step (1 = full batch)
    init_scale: float = 0.1
    rescale_items: bool = True           # rescale released V to mean row norm 1 after each update (public
                                         # post-processing) so user_reg has the same meaning at every step
    n_shards: int | None = None          # devices for the item update (ALS / SSP methods); None: all local
                                         # devices (one device: no mesh). Results do not depend on it.
    merge_duplicates: bool = False       # opt-in: merge duplicate (user, item) rows into their mean rating
                                         # (Interactions.merge_duplicates) before anything private runs;
                                         # False: duplicates raise ValueError
    show_progress: bool = True

    @property
    def private(self) -> bool:
        return self.method != "als"

    def resolve(self) -> "AltMinConfig":
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        lo, hi = self.rating_range
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
            raise ValueError(f"rating_range must be finite with hi > lo, got {self.rating_range}")
        if self.private:
            check_epsilon(self.epsilon)
        check_delta(self.delta)
        check_positive(self.mu, "mu", allow_zero=True)
        check_positive(self.user_clip, "user_clip")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        for name in ("count_fraction", "center_fraction"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if self.count_fraction + self.center_fraction >= 1:
            raise ValueError("count_fraction + center_fraction must be < 1")
        if self.weight_mode not in ("clip", "normalize"):
            raise ValueError(f"weight_mode must be 'clip' or 'normalize', got {self.weight_mode!r}")
        eps = self.epsilon if self.private else math.inf
        dim = self.dim if self.dim is not None else (None if self.private else 32)  # private: fit() → default_dim()
        steps = self.steps if self.steps is not None else (10 if not self.private else 2 if eps <= 2 else 3 if eps <= 10 else 4)
        if (dim is not None and dim < 1) or steps < 1:
            raise ValueError(f"dim and steps must be >= 1, got {dim}, {steps}")
        label_clip = self.label_clip if self.label_clip is not None else 0.5 * (hi - lo)
        check_positive(label_clip, "label_clip")
        user_reg = self.user_reg if self.user_reg is not None else (1.0 if self.private else 5.0)
        return dataclasses.replace(self, dim=dim, steps=steps, label_clip=label_clip, user_reg=user_reg,
                                   epsilon=self.epsilon if self.private else None)


@dataclasses.dataclass
class AltMinModel:
    """The released item matrix V (+ the released mean) and how it was obtained."""
    item_factors: np.ndarray   # [n_items, d]
    mean: float
    config: AltMinConfig
    report: PrivacyReport
    noise_multiplier: float | None
    timings: dict
    seed: int | None = None  # the noise seed: reproduces the run; as secret as the data

    def user_factors(self, history: Interactions) -> np.ndarray:
        """Each user's embedding solved from V and the user's own ratings (no privacy cost)."""
        return solve_users(history, self.item_factors, self.mean, self.config.user_reg)

    def predict(self, user_factors: np.ndarray, user: np.ndarray, item: np.ndarray) -> np.ndarray:
        lo, hi = self.config.rating_range
        pred = self.mean + np.einsum("nd,nd->n", user_factors[user], self.item_factors[item])
        return np.clip(pred, lo, hi)


class UserSolver:
    """Exact per-user ridge solves u_j = (Σ_{i∈Ω_j} v_i v_iᵀ + λ_u I)⁻¹ Σ_{i∈Ω_j} (r_ij − mean) v_i.

    The observation layout is built once (it does not change across steps); users are solved in
    blocks of USERS_PER_BLOCK to bound memory (one d×d matrix per user in flight).
    """

    def __init__(self, data: Interactions, mean: float, user_reg: float):
        n_blocks = max(1, -(-data.n_users // USERS_PER_BLOCK))
        plan = gram.build_plan(data.user, data.item, None, data.n_users, n_shards=n_blocks)
        self.classes, self.stack_index = gram.device_arrays(plan, plan.slot_values(data.rating - mean))
        self.global_task, self.flat_index = jnp.asarray(plan.global_task), jnp.asarray(plan.flat_index)
        self.user_reg = float(user_reg)

    def __call__(self, item_factors) -> jax.Array:
        u = solve_tasks(jnp.asarray(item_factors, jnp.float32), self.classes, self.stack_index, self.global_task,
                        jax.random.key(0), 0.0, 0.0, self.user_reg, mesh=None, noisy=False)
        return u[self.flat_index]


def solve_users(data: Interactions, item_factors: np.ndarray, mean: float, user_reg: float) -> np.ndarray:
    """Every user's embedding [n_users, d] from the item matrix and the user's own ratings."""
    return np.asarray(UserSolver(data, mean, user_reg)(item_factors))


def _preprocess_event(sigma_c: float, n_gaussians: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma_c), n_gaussians)


def _training_event(cfg: AltMinConfig, sigma: float) -> dp_accounting.DpEvent:
    if cfg.method.startswith("dpsgd") or cfg.method == "ada-dpsgd":
        sgd = NoisyGDConfig(cfg.sgd_clip, sigma, cfg.sgd_inner_steps, 1.0, sample_rate=cfg.sample_rate)
        return dp_accounting.SelfComposedDpEvent(sgd.step_event(), cfg.steps * cfg.sgd_inner_steps)
    step = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma)] * 2)  # A and b
    return dp_accounting.SelfComposedDpEvent(step, cfg.steps)


def calibrate_noise(cfg: AltMinConfig) -> tuple[float | None, float | None, float]:
    """(σ for the mean, σ for the counts, σ for training): the pre-processing noise multipliers are set so
    that each alone would spend its fraction of ε; then σ is found by bisection so that the composition
    of everything spends exactly (ε, δ)."""
    pre, sigma_mean, sigma_counts = [], None, None
    if cfg.center:
        sigma_mean = calibrate(lambda s: _preprocess_event(s, 2), cfg.center_fraction * cfg.epsilon, cfg.delta,
                               bracket=(1e-2, 1e7))
        pre.append(_preprocess_event(sigma_mean, 2))
    if _needs_counts(cfg.method):
        sigma_counts = calibrate(lambda s: _preprocess_event(s, 1), cfg.count_fraction * cfg.epsilon, cfg.delta,
                                 bracket=(1e-2, 1e7))
        pre.append(_preprocess_event(sigma_counts, 1))
    sigma = calibrate(lambda s: dp_accounting.ComposedDpEvent(pre + [_training_event(cfg, s)]), cfg.epsilon,
                      cfg.delta, bracket=(1e-2, 1e7))
    return sigma_mean, sigma_counts, sigma


def candidate_event(cfg: AltMinConfig) -> dp_accounting.DpEvent:
    """The composed dp_accounting event of a private fit with `cfg` (noise calibrated to cfg.epsilon)."""
    cfg = cfg.resolve()
    if not cfg.private:
        raise ValueError(f"method {cfg.method!r} is the non-private reference: it has no privacy event")
    sigma_mean, sigma_counts, sigma = calibrate_noise(cfg)
    pre = [_preprocess_event(sigma_mean, 2)] if cfg.center else []
    pre += [_preprocess_event(sigma_counts, 1)] if _needs_counts(cfg.method) else []
    return dp_accounting.ComposedDpEvent(pre + [_training_event(cfg, sigma)])


def default_dim(n_users: int, n_items: int, budget: int, noise_multiplier: float) -> int:
    """Default embedding dimension of a private run, from PUBLIC quantities only: the declared sizes
    (n_users: the user id space / a public bound on the users, n_items: the item catalogue; never
    counts of the users or items present in the data), k and σ.

    Each item's noisy Gram has noise of spectral size ≈ 2√d·σ√k·Γ² while its signal per direction is
    ≈ c·Γ²/d for a per-item budget c ≤ min(n_users·k/n_items, n_users); so the usable dimension grows
    with x = c / (2σ√k). Theory with a flat spectrum gives d ∝ x^(2/3); rating matrices have decaying
    spectra, and validation RMSE of dpals-uniform (two planted power-law sets of 20k and 70k users at
    ε = 1, 5, 20, and ML-100K at ε = 5, 20) followed d ≈ 2·x^(1/3), rounded to a power of two and
    kept in [2, 32]. Too large a d costs far more than too small a d (ML10M-scale synthetic, validation
    RMSE: ε = 20 d = 32 0.834 vs d = 8 0.708; ε = 5 d = 4 0.775 vs d = 8 0.763). The rule errs small at
    that scale: there it gives 4 at ε = 1 and 5, while the mean validation RMSE over 3 seeds preferred 8.
    """
    if min(n_users, n_items, budget) < 1:
        raise ValueError(f"n_users, n_items and budget must be >= 1, got {n_users}, {n_items}, {budget}")
    check_positive(noise_multiplier, "noise_multiplier")
    per_item = min(n_users * budget / n_items, float(n_users))
    x = per_item / (2 * noise_multiplier * math.sqrt(budget))
    return int(min(32, max(2, 2 ** round(math.log2(2 * x ** (1 / 3))))))


def _needs_counts(method: str) -> bool:
    return method.endswith("tail") or method.startswith("ada")


def fit(train: Interactions, cfg: AltMinConfig, seed: int | None = None) -> AltMinModel:
    """Trains with `cfg.method` on `train` and returns the released item matrix and the PrivacyReport.

    Unit: a user; relation: add/remove all ratings of one user. `train.n_users` / `train.n_items` are
    used as PUBLIC sizes (user id space, item catalogue; see the module docstring) and recorded as
    assumptions in the report. Duplicate (user, item) rows raise ValueError, for every method, unless
    `cfg.merge_duplicates` (then they are merged into their mean rating first).
    `seed` seeds every noise draw; None (the default) draws fresh OS entropy, recorded in `model.seed`.
    Pass a seed only to reproduce an experiment: whoever knows it can subtract the noise.
    """
    cfg = cfg.resolve()
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
    timings = {}
    t0 = time.perf_counter()
    key, seed = seeded_key(seed)
    k_mean, k_counts, k_weights, k_init, k_train = jax.random.split(key, 5)
    user, item = jnp.asarray(train.user), jnp.asarray(train.item)
    n_users, n_items, k = train.n_users, train.n_items, cfg.budget
    report = PrivacyReport(cfg.delta, unit="user", relation="add/remove all ratings of one user")
    report.assume(f"public sizes declared by the caller: n_users={n_users} (user id space, a bound on the "
                  f"number of users), n_items={n_items} (item catalogue); not counted from the ratings")
    report.assume(f"public rating scale {tuple(cfg.rating_range)}")
    if cfg.merge_duplicates:
        report.assume("duplicate (user, item) ratings merged into their mean per user before training")

    # Noise calibration, then pre-processing.
    sigma_mean, sigma_counts, sigma = calibrate_noise(cfg) if cfg.private else (None, None, None)
    if cfg.dim is None:
        cfg = dataclasses.replace(cfg, dim=default_dim(n_users, n_items, k, sigma))
    if not cfg.private:
        report.add("NON-PRIVATE reference (exact statistics)", dp_accounting.NonPrivateDpEvent())
        mean = float(train.rating.mean()) if cfg.center else 0.0
    elif cfg.center:
        mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)  # shift by the public midpoint: smaller sensitivity
        mean = mid + private_mean(k_mean, user, jnp.asarray(train.rating - mid), half, k, sigma_mean, report)
    else:
        mean = 0.0
    counts = None
    if cfg.private and _needs_counts(cfg.method):
        counts = private_counts(k_counts, user, item, n_items, k, sigma_counts, report, name="item counts").counts

    # Budget allocation as weights with Σ_i w_ij² ≤ k for every user.
    if not cfg.private:
        weights = jnp.ones(train.nnz, jnp.float32)
    elif cfg.method.endswith("uniform"):
        weights = uniform_sampling_weights(k_weights, user, k)
    elif cfg.method.endswith("tail"):
        weights = tail_sampling_weights(k_weights, user, item, counts, k)
    else:
        weights = adaptive_weights(counts, user, item, n_users, float(k), cfg.mu, cfg.weight_mode)
    weights = np.asarray(weights)
    if cfg.private:
        check_user_budget(train.user, weights, n_users, float(k))
    timings["preprocess_seconds"] = time.perf_counter() - t0

    # Item-side plan (fixed across steps): tasks = items, features = user embeddings.
    t1 = time.perf_counter()
    # Item updates by ridge solve (ALS, SSP) shard across devices.
    mesh = task_mesh(cfg.n_shards) if cfg.method.startswith(("als", "dpals", "ada-dpals")) else None
    labels = np.clip(train.rating - mean, -cfg.label_clip, cfg.label_clip) if cfg.private else train.rating - mean
    d = cfg.dim
    is_sgd = "sgd" in cfg.method
    if not is_sgd:
        n_dev = 1 if mesh is None else mesh.size
        plan = gram.build_plan(train.item, train.user, weights, n_items, n_shards=n_dev)
        classes, stack_index = gram.device_arrays(plan, plan.slot_values(labels))
        global_task, flat_index = jnp.asarray(plan.global_task), jnp.asarray(plan.flat_index)
    timings["plan_seconds"] = time.perf_counter() - t1

    gamma, gy = cfg.user_clip, cfg.label_clip
    if cfg.private and not is_sgd:
        std_a, std_b = sigma * math.sqrt(k) * gamma**2, sigma * math.sqrt(k) * gamma * gy
        lam = cfg.reg if cfg.reg is not None else cfg.reg_scale * 2 * math.sqrt(d) * std_a
    else:
        std_a = std_b = 0.0
        lam = cfg.reg if cfg.reg is not None else (cfg.user_reg if not cfg.private else 1.0)
    if is_sgd:
        sgd = NoisyGDConfig(cfg.sgd_clip, sigma if cfg.private else 1.0, cfg.sgd_inner_steps,
                            cfg.sgd_lr or 0.5, lam=lam if cfg.reg is not None else 0.0, sample_rate=cfg.sample_rate)

    v = cfg.init_scale * jax.random.normal(k_init, (n_items, d), jnp.float32)
    user_solver = UserSolver(train, mean, cfg.user_reg)
    step_seconds = []
    for t in tqdm(range(cfg.steps), desc=f"{cfg.method}", disable=not cfg.show_progress, leave=False):
        ts = time.perf_counter()
        u = user_solver(v)
        feats = clip_by_norm(u, gamma) if cfg.private else u
        k_step = jax.random.fold_in(k_train, t)
        if not is_sgd:
            theta = solve_tasks(feats, classes, stack_index, global_task, k_step, std_a, std_b, lam,
                                mesh=mesh, noisy=cfg.private)
            v = theta[flat_index]
        else:
            v = _noisy_gd_run(k_step, v, item, user, feats[user], jnp.asarray(labels, jnp.float32),
                              jnp.asarray(weights), n_items, n_users, sgd.steps, sgd.clip_norm,
                              sgd.noise_multiplier if cfg.private else 0.0, sgd.learning_rate, sgd.lam,
                              sgd.sample_rate, jnp.inf)
        if cfg.rescale_items:
            v = v / jnp.maximum(jnp.mean(jnp.linalg.norm(v, axis=1)), 1e-12)
        v = jax.block_until_ready(v)
        step_seconds.append(time.perf_counter() - ts)
    if cfg.private:
        if is_sgd:
            record_noisy_gd_releases(report, sgd, count=cfg.steps, prefix="item update (noisy GD)")
        else:
            record_ssp_releases(report, sigma, float(k), gamma, gy, count=cfg.steps, prefix="item update (SSP)")
    timings["step_seconds"] = step_seconds
    timings["train_seconds"] = time.perf_counter() - t0
    return AltMinModel(np.asarray(v), float(mean), cfg, report, sigma, timings, seed)


def evaluate_ratings(model: AltMinModel, history: Interactions, test: Interactions,
                     item_buckets: np.ndarray | None = None) -> dict:
    """RMSE on `test` with user embeddings solved from `history`; per-bucket RMSE if buckets given."""
    from jdp.metrics import sliced_rmse
    u = model.user_factors(history)
    pred = model.predict(u, test.user, test.item)
    out = {"rmse_test": float(np.sqrt(np.mean((pred - test.rating) ** 2)))}
    if item_buckets is not None:
        out["sliced"] = {"rmse_by_bucket": sliced_rmse(pred, test.rating, test.item, item_buckets)}
    return out
