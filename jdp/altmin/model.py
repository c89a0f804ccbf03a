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
import functools
import math
import time
from typing import NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jdp.accounting import ADD_OR_REMOVE_ONE, PrivacyReport, Release, calibrate
from jdp.data import Interactions, check_unique_pairs
from jdp.multitask import gram, noisy_gd
from jdp.multitask.counts import (count_releases, label_sum_releases, private_counts, private_mean,
                                  private_total_count, total_count_releases)
from jdp.multitask.noisy_gd import NoisyGDConfig, noisy_gd_releases
from jdp.multitask.ssp import (check_user_budget, clip_label_norms, count_posterior_mean, solve_tasks, ssp_releases,
                               task_mesh)
from jdp.multitask.weights import adaptive_weights, tail_sampling_weights, task_weights, uniform_sampling_weights
from jdp.noise import clip_by_norm, seeded_key, standard_normal
from jdp.validation import check_positive, check_privacy

RIDGE, NOISY_GD = "ridge", "noisy_gd"  # item update rules
ALLOCATIONS = ("none", "uniform", "tail", "adaptive")  # how a user's budget k is spread over the user's ratings


@dataclasses.dataclass(frozen=True)
class Method:
    """What a method name means, parsed once (`Method.parse`).

    rule: how the item side is updated: RIDGE, a ridge solve per item of its sufficient statistics (noisy,
    by SSP, when private; exact for 'als'), or NOISY_GD, task-weighted noisy gradient descent.
    allocation: 'uniform' / 'tail' sampling of k ratings per user, 'adaptive' weights n̂_i^(−μ), or 'none'
    (every rating at weight 1: the non-private 'als')."""
    rule: str
    allocation: str

    def __post_init__(self):
        if self.rule not in (RIDGE, NOISY_GD) or self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown update rule {self.rule!r} or allocation {self.allocation!r}")
        if self.allocation == "none" and self.rule != RIDGE:
            raise ValueError("the non-private reference (allocation 'none') is the exact ridge solve")

    @property
    def private(self) -> bool:
        return self.allocation != "none"

    @property
    def needs_counts(self) -> bool:
        """Whether the method can read the private item counts (whether a fit does: `AltMinConfig.releases_counts`):
        tail sampling and adaptive weights for the allocation, noisy GD for its per-item step caps."""
        return self.allocation in ("tail", "adaptive") or (self.rule == NOISY_GD and self.private)

    @property
    def optional_counts(self) -> bool:
        """Whether the count release is optional (`AltMinConfig.count_release`, resolved by `counts_useful`):
        every method that can read counts except tail sampling, which cannot run without them."""
        return self.needs_counts and self.allocation != "tail"

    @staticmethod
    def parse(method: str) -> "Method":
        if method not in _METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        return _METHODS[method]


_METHODS = {"als": Method(RIDGE, "none"),
            "dpals-uniform": Method(RIDGE, "uniform"), "dpals-tail": Method(RIDGE, "tail"),
            "ada-dpals": Method(RIDGE, "adaptive"),
            "dpsgd-uniform": Method(NOISY_GD, "uniform"), "dpsgd-tail": Method(NOISY_GD, "tail"),
            "ada-dpsgd": Method(NOISY_GD, "adaptive")}
METHODS = tuple(_METHODS)


def _bias_priors(cfg: "AltMinConfig") -> tuple[float, float]:
    """(s², τ₀²): the public residual variance (Γy/2)² and item-bias prior variance (Γy/4)² (1 and 0.25 on 1–5 stars)."""
    return (cfg.label_clip / 2) ** 2, (cfg.label_clip / 4) ** 2


TUNE_SPLIT_SEED = 0  # fit(tune="private") without valid: the train/valid split (public randomness, never noise)
TUNE_VALID_FRACTION = 0.1  # fit(tune="private") without valid: each row goes to valid with this probability
COUNT_UCB = 2.0  # item_step_sizes: an item's count is at most its released count + 2 noise stds (no overshoot)
POPULARITY_MIN_LOG_RANGE = 1.0  # item_bias_prior_mean: the resolved counts must span a factor e to fit a slope
MIN_DIRECTION_SNR = 4.0  # default_dim: below this signal-to-noise ratio of one direction, rank 0 (biases only)
USERS_PER_BLOCK = 16384  # user solves run in blocks of this many users to bound memory (A is d×d per user)


class _DefaultScale(tuple):
    """AltMinConfig.rating_range left at its default (0.5, 5): a scale the data declare replaces it."""


@dataclasses.dataclass(frozen=True)
class AltMinConfig:
    """Hyper-parameters. `None` fields take the documented defaults in `resolve()` (and `fit()` for dim),
    which depend only on public quantities (ε, δ, the rating scale, the declared sizes), never on the ratings."""
    method: str = "ada-dpals"
    epsilon: float | None = 1.0          # None for 'als'
    delta: float = 1e-5
    dim: int | None = None               # rank of u·v. Private default: default_dim() from the public sizes and the
                                         # calibrated noise (0 … 32; 0 = biases only); 'als': 32
    steps: int | None = None             # 2 (ε≤2), 3 (ε≤10), 4 otherwise; ALS 10
    mu: float = 0.25                     # adaptive exponent (ada-*)
    budget: int = 100                    # k: per-user squared-weight budget β = k; also count_sample
    weight_mode: str = "clip"            # 'clip' (paper, eq. 12) or 'normalize' (reference code)
    user_clip: float = 0.5               # Γ: ‖u_j‖ clip for features. λ and the noise scale with Γ², so only
                                         # the share of users clipped matters: with V at mean row norm 1 most
                                         # users exceed 0.5 and land on the sphere, which gives the most signal
                                         # per unit of sensitivity (measured: never worse than 1.0, 1% better
                                         # RMSE at ε = 1 on the ML10M-scale synthetic)
    biases: bool = True                  # r̂ = μ + b_u + c_i + u·v: user bias b_u solved on the user side (free),
                                         # item bias c_i released in the same private item update
    bias_clip: float | None = None       # γ₀: the constant feature that carries c_i in the item update (default Γ:
                                         # the bias gets the same signal-to-noise as one factor direction; 'als':
                                         # 1, so the item bias has the item ridge λ); the
                                         # item update's feature bound becomes √(Γ² + γ₀²)
    label_clip: float | None = None      # Γy on residual ratings; default half the rating range
    label_norm: float | None = None      # L: SSP item update, each user's weighted residuals scaled to
                                         # √(Σ_i w_ij² y_ij²) ≤ L (b's sensitivity Γx·L instead of Γx·√k·Γy).
                                         # Default at rank 0 (`default_label_norm`): √k·Γy/2; with factors: none
                                         # (a value ≥ √k·Γy never binds)
    rating_range: tuple[float, float] = _DefaultScale((0.5, 5.0))  # PUBLIC rating scale; default: the data's
                                         # declared scale (Interactions.rating_range, e.g. load_movielens'), else 0.5-5
    global_mean: str | float | None = None  # μ. 'prior' (private default): the public midpoint of rating_range,
                                         # no ε spent: the user biases absorb the offset; a float: a public prior
                                         # declared by the caller; 'private': a private estimate spending
                                         # center_fraction of ε; 'exact' ('als' default): the non-private mean
    reg: float | None = None             # item ridge λ; default noise-aware: reg_scale·2√(d+1)·std(A noise)
    reg_scale: float = 2.0
    user_reg: float | None = None        # user ridge on u; default 1.0 (private) / 0.1 per rating ('als', ALS-WR)
    reg_per_rating: bool | None = None   # weighted-λ regularisation (ALS-WR, Zhou et al. 2008): the user ridges (and
                                         # the 'als' item ridge) are λ·(number of ratings of the user / item).
                                         # Default: True for 'als', False for private methods
    user_bias_reg: float | None = None   # user ridge on b_u (shrinks it to the prior μ); per rating: user_reg; else 5.0 = the ratio of
                                         # rating noise to user-bias variance, (σ_r / σ_b)² ≈ (1 / 0.45)², in
                                         # units of the rating scale (scale-free, so public)
    user_slope_reg: float | None = None  # predictions: each user also scales the released item biases,
                                         # r̂ = μ + b_u + a_u·c_i + u·v, a_u solved on the user's side (free, like
                                         # b_u; Koren 2009's user-scaled item bias) with ridge user_slope_reg·(a_u − 1)².
                                         # Default (private methods): Γy² = s²/τa², the public residual variance
                                         # s² = (Γy/2)² over a prior a_u ~ N(1, τa² = 1/4) (a_u in [0, 2] at two prior
                                         # stds: from ignoring item quality to twice its weight); 4 on 1–5 stars.
                                         # math.inf: a_u = 1.
                                         # 'als' (or no biases, or per-rating ridges): inf (the non-private
                                         # reference keeps its tuned model).
                                         # Training's own user solves keep a_u = 1 (the item update's features stay γ₀)
    item_bias_mean: str = "popularity"   # SSP methods at rank 0: the centre of the empirical-Bayes item-bias prior.
                                         # 'popularity' (`item_bias_prior_mean`): a line in the log count fitted to
                                         # the well-resolved items of the same release (post-processing): rarely
                                         # rated items are rated lower on real data, and the line's intercept takes
                                         # up the offset the users' bias ridge leaves; 0 where it cannot be fitted.
                                         # 'zero': 0. With factors (rank > 0) the prior is centred on 0 either way
    count_fraction: float = 0.12         # ε share that sets the noise of the private item counts
    count_release: bool | None = None    # ada-*, dpsgd-uniform: release the item counts (the weights n̂_i^(−μ); noisy
                                         # GD's per-item step caps). None: only when they are of use (`counts_useful`,
                                         # from public sizes and σ); without them ω_i = 1 (μ = 0: every rating of a
                                         # user weighs min(1, √(k/n_j))), noisy GD caps every step at that of an
                                         # item all users rated, and all of ε goes to the item update
    center_fraction: float = 0.1         # ε share of the private global mean (global_mean='private' only)
    ratings_per_user: float | None = None  # r̄: mean of min(n_j, k) over the declared users, if the caller declares
                                         # it PUBLIC; None: the rank rule assumes every user spends k and, when that
                                         # gives a rank > 0 (SSP methods), checks it against a released total
                                         # (`plan_run`), spending size_fraction of ε
    size_fraction: float = 0.05          # ε share that sets the noise of that released total
    sgd_inner_steps: int = 4             # noisy GD updates per outer step (dpsgd-*)
    sgd_clip: float = 1.0                # per-user gradient clip C (dpsgd-*)
    sgd_lr: float | None = None          # None: per-item steps from the released counts (`item_step_sizes`);
                                         # a float: one step size for every item. Each noisy-GD update divides
                                         # the summed gradient by q·n_users (n_users: the declared public size)
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

    def for_data(self, data: Interactions) -> "AltMinConfig":
        """This config for `data`: a rating_range left at its default becomes the scale the data declare."""
        if isinstance(self.rating_range, _DefaultScale) and getattr(data, "rating_range", None) is not None:
            return dataclasses.replace(self, rating_range=tuple(data.rating_range))
        return self

    @property
    def parsed_method(self) -> Method:
        """`method` as (update rule, budget allocation); ValueError for an unknown name."""
        return Method.parse(self.method)

    @property
    def private(self) -> bool:
        return self.parsed_method.private

    def resolve(self) -> "AltMinConfig":
        Method.parse(self.method)
        lo, hi = self.rating_range
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
            raise ValueError(f"rating_range must be finite with hi > lo, got {self.rating_range}")
        check_privacy(self.epsilon if self.private else None, self.delta, None, unit="user")  # δ < 1/n: in `fit`
        check_positive(self.mu, "mu", allow_zero=True)
        check_positive(self.user_clip, "user_clip")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        for name in ("count_fraction", "center_fraction", "size_fraction"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if self.count_fraction + self.center_fraction + self.size_fraction >= 1:
            raise ValueError("count_fraction + center_fraction + size_fraction must be < 1")
        if self.ratings_per_user is not None and not 0 <= self.ratings_per_user <= self.budget:
            raise ValueError(f"ratings_per_user (a declared public mean of min(n_j, k)) must lie in [0, budget = "
                             f"{self.budget}], got {self.ratings_per_user}")
        if self.count_release is not None and (not isinstance(self.count_release, bool)
                                               or not self.parsed_method.optional_counts):
            raise ValueError(f"count_release must be None, True or False, and only for the methods whose count "
                             f"release is optional ({', '.join(m for m in METHODS if Method.parse(m).optional_counts)}); "
                             f"got {self.count_release!r} for {self.method!r}")
        if self.weight_mode not in ("clip", "normalize"):
            raise ValueError(f"weight_mode must be 'clip' or 'normalize', got {self.weight_mode!r}")
        global_mean = self.global_mean if self.global_mean is not None else ("prior" if self.private else "exact")
        if isinstance(global_mean, str):
            if global_mean not in ("prior", "private", "exact"):
                raise ValueError(f"global_mean must be 'prior', 'private', 'exact' or a float, got {global_mean!r}")
            if global_mean == "exact" and self.private:
                raise ValueError("global_mean='exact' reads the ratings without noise: only for the non-private 'als'")
            if global_mean == "private" and not self.private:
                global_mean = "exact"
        elif not (math.isfinite(global_mean) and lo <= global_mean <= hi):
            raise ValueError(f"a declared global_mean prior must lie in rating_range {self.rating_range}, got {global_mean}")
        eps = self.epsilon if self.private else math.inf
        dim = self.dim if self.dim is not None else (None if self.private else 32)  # private: fit() → default_dim()
        steps = self.steps if self.steps is not None else (10 if not self.private else 2 if eps <= 2 else 3 if eps <= 10 else 4)
        if (dim is not None and dim < (0 if self.biases else 1)) or steps < 1:
            raise ValueError(f"dim must be >= {0 if self.biases else 1} (0: biases only) and steps >= 1, "
                             f"got {dim}, {steps}")
        label_clip = self.label_clip if self.label_clip is not None else 0.5 * (hi - lo)
        check_positive(label_clip, "label_clip")
        label_norm = None  # only the private SSP update bounds label norms
        ssp = self.private and self.parsed_method.rule == RIDGE
        if self.item_bias_mean not in ("zero", "popularity"):  # read by the private SSP methods' default ridge
            raise ValueError(f"item_bias_mean must be 'zero' or 'popularity', got {self.item_bias_mean!r}")
        if self.label_norm is not None and not ssp:
            raise ValueError(f"label_norm bounds the labels of the private SSP item update (dpals-*, ada-dpals); "
                             f"method {self.method!r} has none")
        if ssp:
            label_norm = (check_positive(self.label_norm, "label_norm") if self.label_norm is not None
                          else default_label_norm(dim, self.budget, label_clip))
        bias_clip = check_positive(self.bias_clip if self.bias_clip is not None else (self.user_clip if self.private else 1.0),
                                   "bias_clip")
        per_rating = self.reg_per_rating if self.reg_per_rating is not None else not self.private
        if per_rating and not self.biases:
            raise ValueError("reg_per_rating needs biases=True (the counts are read off the bias column)")
        user_reg = check_positive(self.user_reg if self.user_reg is not None else (1.0 if self.private else 0.1),
                                  "user_reg")
        user_bias_reg = check_positive(self.user_bias_reg if self.user_bias_reg is not None
                                       else (user_reg if per_rating else 5.0), "user_bias_reg")
        user_slope_reg = (self.user_slope_reg if self.user_slope_reg is not None
                          else label_clip ** 2 if self.private and self.biases and not per_rating  # s²/τa²
                          else math.inf)
        if math.isfinite(user_slope_reg):
            user_slope_reg = check_positive(user_slope_reg, "user_slope_reg")
        elif user_slope_reg != math.inf:
            raise ValueError(f"user_slope_reg must be > 0 (math.inf: off), got {self.user_slope_reg!r}")
        if math.isfinite(user_slope_reg) and (per_rating or not self.biases):
            raise ValueError("user_slope_reg scales the item biases on the user side: it needs biases=True and "
                             "reg_per_rating=False (pass user_slope_reg=math.inf to turn it off)")
        return dataclasses.replace(self, dim=dim, steps=steps, label_clip=label_clip, label_norm=label_norm,
                                   user_reg=user_reg,
                                   bias_clip=bias_clip, user_bias_reg=user_bias_reg, user_slope_reg=user_slope_reg,
                                   global_mean=global_mean,
                                   reg_per_rating=per_rating,
                                   epsilon=self.epsilon if self.private else None)

    @property
    def releases_counts(self) -> bool:
        """Whether a fit releases private item counts: tail sampling always; the adaptive methods and
        dpsgd-uniform unless `count_release` is False (`plan_run` resolves None by `counts_useful`)."""
        method = self.parsed_method
        if method.optional_counts:
            return self.count_release is not False
        return method.needs_counts

    @property
    def label_bound(self) -> float:
        """The per-rating label bound the SSP sensitivity uses (resolved config): Γy, or L/√k when the per-user
        label norm L is the tighter bound (`jdp.multitask.ssp.clip_label_norms`)."""
        if self.label_norm is None:
            return self.label_clip
        return min(self.label_clip, self.label_norm / math.sqrt(self.budget))

    @property
    def item_feature_bound(self) -> float:
        """The norm bound of one user's feature x_j = [clip(u_j, Γ), γ₀] in the item update (resolved config;
        rank 0 drops u_j, no biases drop γ₀)."""
        if not self.biases:
            return self.user_clip
        return self.bias_clip if self.dim == 0 else math.hypot(self.user_clip, self.bias_clip)


class UserEmbeddings(NamedTuple):
    """Each user's solved embedding u_j [n_users, d], bias b_j [n_users] (0 without biases) and the scale a_j
    [n_users] the user puts on the released item biases (None: 1 for everyone)."""
    factors: np.ndarray
    bias: np.ndarray
    slope: np.ndarray | None = None


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
                       _prior(cfg), cfg, report, None, {}, None)


def _prior(cfg: AltMinConfig) -> float:
    lo, hi = cfg.rating_range
    return float(cfg.global_mean) if not isinstance(cfg.global_mean, str) else 0.5 * (lo + hi)


# Small jitted kernels for the host loop: run eagerly, every jnp operation compiles a kernel of its own per new
# shape (most of a small fit's first run).
@jax.jit
def _residuals(rating, index, bias, mean, clip):
    """clip(r − μ − bias[index], ±clip) in float32 (clip = inf: unclipped)."""
    resid = rating - mean - jnp.asarray(bias, jnp.float32)[index]
    return jnp.clip(resid, -clip, clip)


@jax.jit
def _rows(x, index):
    return x[index]


@jax.jit
def _with_constant_column(v, value):
    v = jnp.asarray(v, jnp.float32)
    return jnp.concatenate([v, jnp.full((v.shape[0], 1), value, jnp.float32)], axis=1)


SMALL_SOLVE_FEATURES = 3  # UserSolver: designs this narrow (rank 0 or 1 with bias and scale) skip the class layout


@functools.partial(jax.jit, static_argnames=("n_users",))
def _small_user_solves(v, item, user, resid, lam, n_users):
    """Every user's ridge solution (Σ_i x_i x_iᵀ + λI)⁻¹ Σ_i r_i x_i for a narrow design x_i = v[item]: the Gram's
    f(f+1)/2 distinct entries as segment sums over the ratings, one batched f×f solve. No per-shape layout to
    compile; for f ≤ SMALL_SOLVE_FEATURES the products take at most 6 values per rating."""
    f = v.shape[1]
    rows, cols = np.triu_indices(f)
    x = v[item]
    entries = jax.ops.segment_sum(x[:, rows] * x[:, cols], user, num_segments=n_users)
    gram = jnp.zeros((n_users, f, f), jnp.float32).at[:, rows, cols].set(entries).at[:, cols, rows].set(entries)
    rhs = jax.ops.segment_sum(x * resid[:, None], user, num_segments=n_users)
    return jnp.linalg.solve(gram + lam * jnp.eye(f, dtype=jnp.float32), rhs[..., None])[..., 0]


class UserSolver:
    """Exact per-user ridge solves of (u_j, b_j) from the released (V, c, μ) and the user's own ratings:
    min Σ_{i∈Ω_j} (r_ij − μ − a_j·c_i − b_j − u_j·v_i)² + λ_u‖u_j‖² + λ_b b_j² + λ_a (a_j − 1)².

    The bias rides as a constant column s = √(λ_u/λ_b) of the design [v_i, s] (one ridge λ_u on the
    coefficients gives the bias the ridge λ_b); with `user_slope_reg` λ_a, a_j − 1 rides likewise as the column
    √(λ_u/λ_a)·c_i before it (the bias column stays last: per-rating ridges read the count off it). The
    observation layout is built once, when first needed; the residual labels are laid out on device each call.
    Users are solved in blocks of USERS_PER_BLOCK to bound memory. Designs of at most SMALL_SOLVE_FEATURES
    columns without per-rating ridges are solved from segment sums instead (`_small_user_solves`, same solutions).
    """

    def __init__(self, data: Interactions, user_reg: float, user_bias_reg: float | None, per_rating: bool = False,
                 user_slope_reg: float = math.inf, fit_slope: bool = True):
        self.data, self._classes = data, None
        self.item, self.rating = jnp.asarray(data.item), jnp.asarray(data.rating, jnp.float32)
        self.user_reg = float(user_reg)
        self.bias_column = None if user_bias_reg is None else math.sqrt(user_reg / user_bias_reg)
        self.slope_column = None if not math.isfinite(user_slope_reg) else math.sqrt(user_reg / user_slope_reg)
        self.fit_slope = fit_slope
        if self.slope_column is not None and (self.bias_column is None or per_rating):
            raise ValueError("user_slope_reg needs a user bias (user_bias_reg) and reg_per_rating=False")
        # per rating: ridge λ·n_j, the count read off the Gram's constant bias column (s² per rating)
        self.count_ridge = None
        if per_rating:
            if self.bias_column is None:
                raise ValueError("reg_per_rating needs biases=True (the count is read off the bias column)")
            self.count_ridge = jnp.asarray([0.0, 0.0, user_reg, self.bias_column**2, 0.0, 1.0], jnp.float32)

    @classmethod
    def for_config(cls, data: Interactions, cfg: AltMinConfig, predict: bool = False) -> "UserSolver":
        """The user solver of a resolved config (its user ridges, biases and per-rating choice); `predict`: the
        final solve behind predictions, which also scales the item biases (`user_slope_reg`). Training's solves
        keep a_j = 1 in the same layout (`fit_slope=False`), so both compile one program per ratings layout."""
        return cls(data, cfg.user_reg, cfg.user_bias_reg if cfg.biases else None, cfg.reg_per_rating,
                   cfg.user_slope_reg, fit_slope=predict)

    def class_layout(self):
        """(classes, class_tasks, stack_index, obs_index, flat_index) of `solve_tasks`, built on first use."""
        if self._classes is None:
            self._classes = _user_layout(self.data)
        return self._classes

    def __call__(self, item_factors, item_bias, mean: float) -> UserEmbeddings:
        v = jnp.asarray(item_factors, jnp.float32)
        if self.slope_column is not None:  # a zero column when a_j is held at 1: a_j − 1 = 0 and b_j exactly as without
            slope = self.slope_column * jnp.asarray(item_bias, jnp.float32) if self.fit_slope else jnp.zeros(v.shape[0])
            v = jnp.concatenate([v, slope[:, None].astype(jnp.float32)], axis=1)
        if self.bias_column is not None:
            v = _with_constant_column(v, self.bias_column)
        resid = _residuals(self.rating, self.item, item_bias, mean, math.inf)
        if v.shape[1] <= SMALL_SOLVE_FEATURES and self.count_ridge is None:
            coef = np.asarray(_small_user_solves(v, self.item, jnp.asarray(self.data.user), resid, self.user_reg,
                                                 self.data.n_users))
        else:
            classes, class_tasks, stack_index, obs_index, flat_index = self.class_layout()
            classes = gram.with_labels(classes, obs_index, resid)
            coef = np.asarray(_rows(solve_tasks(v, classes, class_tasks, stack_index, jax.random.key(0), 0.0, 0.0,
                                                self.user_reg if self.count_ridge is None else 1e-6, mesh=None,
                                                noisy=False, count_ridge=self.count_ridge), flat_index))
        if self.bias_column is None:
            return UserEmbeddings(coef, np.zeros(coef.shape[0], np.float32))
        bias = coef[:, -1] * np.float32(self.bias_column)
        if self.slope_column is None:
            return UserEmbeddings(coef[:, :-1], bias)
        if not self.fit_slope:
            return UserEmbeddings(coef[:, :-2], bias)
        return UserEmbeddings(coef[:, :-2], bias, 1.0 + coef[:, -2] * np.float32(self.slope_column))


def _user_layout(data: Interactions):
    """The per-user class layout of `solve_tasks` (blocks of USERS_PER_BLOCK users)."""
    plan = gram.build_plan(data.user, data.item, None, data.n_users,
                           n_shards=max(1, -(-data.n_users // USERS_PER_BLOCK)))
    classes, stack_index = gram.device_arrays(plan)
    return classes, gram.class_tasks(plan), stack_index, gram.observation_index(plan), jnp.asarray(plan.flat_index)


def solve_users(data: Interactions, item_factors: np.ndarray, item_bias: np.ndarray, mean: float, user_reg: float,
                user_bias_reg: float | None = None) -> UserEmbeddings:
    """Every user's embedding and bias from the release and the user's own ratings (no privacy cost)."""
    return UserSolver(data, user_reg, user_bias_reg)(item_factors, item_bias, mean)


class NoiseMultipliers(NamedTuple):
    """σ of each private part of a run: the global mean (None unless global_mean='private'), the item counts
    (None unless the allocation reads them), the item updates and the budget-clipped rating total of the
    rank check (None unless `plan_run` makes it)."""
    mean: float | None
    counts: float | None
    training: float
    size: float | None = None


class RunPlan(NamedTuple):
    """What a fit on the declared public sizes runs and releases, fixed before any rating is read."""
    config: AltMinConfig             # resolved, dim and steps filled in
    noise: NoiseMultipliers | None   # None for the non-private 'als'
    releases: list[Release]          # every release of the run, in the order fit makes them

    def event(self) -> dp_accounting.DpEvent:
        return _composed(self.releases)


def _composed(releases: list[Release]) -> dp_accounting.DpEvent:
    return dp_accounting.ComposedDpEvent([r.composed_event() for r in releases])


def _mean_bounds(cfg: AltMinConfig) -> tuple[float, float]:
    """(midpoint, half-range) of the public rating scale: the private mean is taken of the ratings shifted by
    the midpoint and clipped to ± the half-range (a smaller sensitivity than the raw ratings have)."""
    lo, hi = cfg.rating_range
    return 0.5 * (lo + hi), 0.5 * (hi - lo)


def _mean_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    return label_sum_releases(_mean_bounds(cfg)[1], cfg.budget, sigma, name="global mean")


def _count_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    releases = count_releases(cfg.budget, sigma, name="item counts")
    if _releases_kept_counts(cfg):  # both inside count_fraction of ε
        releases += count_releases(cfg.budget, sigma, name=KEPT_COUNTS)
    return releases


KEPT_COUNTS = "item counts of the tail sample"


def _releases_kept_counts(cfg: AltMinConfig) -> bool:
    """dpsgd-tail: a second count release, of the ratings the tail sample kept, for the noisy-GD step caps. The raw
    counts choose the sample but bound a popular item's kept ratings loosely (a user keeps their k least popular
    items), so caps from them held popular items still: on the ML10M-scale synthetic (2 splits) dpsgd-tail reached
    0.841 / 0.847 test RMSE at ε = 1 / 5 with them, 0.818 with the kept counts at √2 their noise."""
    method = cfg.parsed_method
    return method.allocation == "tail" and method.rule == NOISY_GD


def _size_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    return total_count_releases(cfg.budget, sigma, name="ratings per user (budget-clipped total)")


def _noisy_gd_config(cfg: AltMinConfig, sigma: float) -> NoisyGDConfig:
    """One noisy-GD item update: `sgd_inner_steps` steps with clip C, step size and the public ridge of `cfg`
    (sgd_lr=None: the 1.0 here is a placeholder, `_NoisyGDItemUpdate` passes the per-item `item_step_sizes`)."""
    return NoisyGDConfig(cfg.sgd_clip, sigma, cfg.sgd_inner_steps, cfg.sgd_lr or 1.0,
                         lam=cfg.reg if cfg.reg is not None else 0.0, sample_rate=cfg.sample_rate)


def _item_update_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    """The releases of the cfg.steps private item updates: SSP's A and b (features ‖x_j‖ ≤ item_feature_bound,
    labels |y| ≤ Γy, Σ_i w_ij² ≤ k), or one noisy-GD step per inner update."""
    if cfg.parsed_method.rule == NOISY_GD:
        return noisy_gd_releases(_noisy_gd_config(cfg, sigma), count=cfg.steps, prefix="item update (noisy GD)")
    once = _gram_released_once(cfg)
    return ssp_releases(sigma, float(cfg.budget), cfg.item_feature_bound, cfg.label_bound, count=cfg.steps,
                        prefix="item update (SSP)", gram_count=1 if once else None,
                        gram_noise_ratio=bias_gram_noise_ratio(cfg) if once else 1.0)


def _gram_released_once(cfg: AltMinConfig) -> bool:
    """Private SSP at rank 0: every user's feature is the public constant γ₀ and the weights are fixed, so every
    step's A_i = γ₀²·Σ_j w_ij is the same statistic: released once, its noisy value reused by later steps.

    The default rank-0 fit takes ONE step. A second step (one more b release) helped where item effects are
    strong and hurt where they are weak, because its labels r − μ − b_j carry the user biases solved from the
    first step's noisy c, whose noise the second release echoes. Measured (ada-dpals, test RMSE, A once at
    σ_A = √2σ_b), 1 vs 2 steps: ML-100K (seeds 0-4) 0.9615 vs 0.9585 at ε = 20, 0.9874 vs 0.9891 at ε = 5; the
    ML10M-scale calibrated synthetic at ε = 1 0.8143 vs 0.8162 (tail buckets 1.0171 vs 1.0007); `jdp demo`'s
    planted data at ε = 1 (3 seeds, item-bias std ≈ 0.07) 0.9432 vs 0.9441 against the zero-cost model's 0.9430:
    two steps would lose to the zero-cost model there, one does not."""
    return cfg.private and cfg.parsed_method.rule == RIDGE and cfg.biases and cfg.dim == 0


def bias_gram_noise_ratio(cfg: AltMinConfig) -> float:
    """A's noise multiplier over b's in a rank-0 SSP item update (resolved config), from public values only.

    The released item bias is c_i = γ₀·b̂_i/Â_i; to first order its noise variance is ∝ σ_b²Γb² + c_i²σ_A² (Γb the
    label bound, A's noise in count units), and the privacy cost of the two Gaussian releases ∝ 1/σ_A² + 1/σ_b².
    For an item bias of the public prior size τ₀ (`_bias_priors`) the minimum is at σ_A/σ_b = √(Γb/τ₀): √2 with
    the default label bound Γy/2 and τ₀ = Γy/4. Measured on ML-100K (ada-dpals, test RMSE, seeds 0-4, one step,
    A released once): ratio 1 / √2 / 2 gave 1.0341 / 1.0312 / 1.0313 at ε = 1, 0.9902 / 0.9874 / 0.9864 at ε = 5."""
    return math.sqrt(cfg.label_bound / math.sqrt(_bias_priors(cfg)[1]))


def run_releases(cfg: AltMinConfig, noise: NoiseMultipliers | None) -> list[Release]:
    """Every release of a fit with the resolved `cfg` at the noise multipliers `noise`, in the order fit makes
    them. This is the ONE description of a run's privacy: `calibrate_noise` composes it to set σ, `fit`
    records it in the report and draws each release's noise at its recorded scale, `candidate_event`
    composes it for `tune_private`."""
    if not cfg.private:
        return [Release("NON-PRIVATE reference (exact statistics)", dp_accounting.NonPrivateDpEvent())]
    releases = []
    if noise.size is not None:
        releases += _size_releases(cfg, noise.size)
    if cfg.global_mean == "private":
        releases += _mean_releases(cfg, noise.mean)
    if cfg.releases_counts:
        releases += _count_releases(cfg, noise.counts)
    return releases + _item_update_releases(cfg, noise.training)


def calibrate_noise(cfg: AltMinConfig, size_release: bool = False) -> NoiseMultipliers:
    """The noise multipliers of a private run with the resolved `cfg`: the pre-processing ones so that each part
    alone spends its fraction of ε (center_fraction for the mean, count_fraction for the counts, size_fraction
    for the rank check's total when `size_release`); then the training σ by root finding so that all of
    `run_releases` composed spends exactly (ε, δ)."""
    if not cfg.private:
        raise ValueError(f"method {cfg.method!r} is the non-private reference: it has no noise to calibrate")

    def sigma_spending(epsilon: float, releases_at) -> float:
        return calibrate(lambda s: _composed(releases_at(s)), epsilon, cfg.delta, bracket=(1e-2, 1e7))

    sigma_mean = sigma_counts = sigma_size = None
    if size_release:
        sigma_size = sigma_spending(cfg.size_fraction * cfg.epsilon, lambda s: _size_releases(cfg, s))
    if cfg.global_mean == "private":
        sigma_mean = sigma_spending(cfg.center_fraction * cfg.epsilon, lambda s: _mean_releases(cfg, s))
    if cfg.releases_counts:
        sigma_counts = sigma_spending(cfg.count_fraction * cfg.epsilon, lambda s: _count_releases(cfg, s))
    sigma = sigma_spending(cfg.epsilon,
                           lambda s: run_releases(cfg, NoiseMultipliers(sigma_mean, sigma_counts, s, sigma_size)))
    return NoiseMultipliers(sigma_mean, sigma_counts, sigma, sigma_size)


def plan_run(cfg: AltMinConfig, n_users: int, n_items: int, released_ratings_per_user: float | None = None) -> RunPlan:
    """The plan of a fit with `cfg` on the declared PUBLIC sizes: the resolved config (dim and steps filled in),
    its noise multipliers and its releases; `fit` and `candidate_event` both use it, so the accounted event is
    the one that runs. An unset dim comes from `default_dim`; when that is 0 (biases only) and steps were not
    set, one step is taken (see `_gram_released_once`) and σ is recalibrated.
    The adaptive methods and dpsgd-uniform release item counts only when `counts_useful` (unless the caller set
    `count_release`). The noisy-GD methods
    default to rank 0 (their default step size does not learn factors from a random start).

    The rank check: `default_dim` needs the users' mean min(n_j, k). Unless the caller declares it
    (cfg.ratings_per_user), the rule first assumes every user spends k, the most the rule could see; if that
    gives rank 0, no user size matters. Otherwise (SSP methods) the plan adds one release, the budget-clipped
    rating total Σ_j min(n_j, k) (sensitivity k, `private_total_count`) at size_fraction of ε, and `fit`
    re-plans with its value, `released_ratings_per_user` (a lower bound: 2 noise stds below the released mean).
    Without it the rule over-estimates the signal of light users: 400 users × 80 items × 20 ratings each
    (`planted_powerlaw`) at ε = 5 got rank 4 and test RMSE 1.05 against the zero-cost model's 0.98.
    Sound under adaptive composition: every release of the SSP methods is a Gaussian without subsampling, and
    each branch (rank, steps, count release) is calibrated to the same total (ε, δ), i.e. the same μ of
    Gaussian DP; the first release is the same in every branch. Until `fit` has the value (and in
    `candidate_event`), the plan uses the optimistic branch, whose composed event is that same Gaussian.
    Noisy GD reaches the rule only without biases (with biases it is rank 0) and keeps the optimistic rank:
    the rule's SSP signal-to-noise model does not describe it. On the same light-user data (factors only,
    3 noise seeds, zero cost 0.979) a checked rank 1 gave 1.01-1.20 and the optimistic rank 4 0.89-0.91
    (dpsgd-uniform, ε = 5; sample_rate 0.5: 1.02-1.18 vs 0.90-0.92; ada-dpsgd 1.06-1.21 vs 0.92-0.94; ε = 20:
    0.99-1.16 vs 0.84-0.87)."""
    steps_given = cfg.steps is not None
    cfg = cfg.resolve()
    if not cfg.private:
        return RunPlan(cfg, None, run_releases(cfg, None))
    noise = calibrate_noise(cfg)
    per_user = cfg.ratings_per_user
    if cfg.dim is None:
        g, g0 = cfg.user_clip, cfg.bias_clip
        share = g**2 / (g**2 + g0**2) if cfg.biases else 1.0
        dim = max(default_dim(n_users, n_items, cfg.budget, noise.training, share, per_user), 0 if cfg.biases else 1)
        if cfg.parsed_method.rule == NOISY_GD and cfg.biases:
            # noisy GD from a random start does not learn factors in the default steps (ML10M-scale synthetic,
            # ε = 5, rank 4: 0.922 vs zero cost 0.912): biases only unless the caller sets dim
            dim = 0
        if dim > 0 and per_user is None and cfg.parsed_method.rule == RIDGE:  # check the rank against the users' sizes
            noise = calibrate_noise(cfg, size_release=True)
            per_user = cfg.budget if released_ratings_per_user is None else released_ratings_per_user
            dim = max(default_dim(n_users, n_items, cfg.budget, noise.training, share, per_user), 0 if cfg.biases else 1)
        cfg = dataclasses.replace(cfg, dim=dim)
        if cfg.parsed_method.rule == RIDGE and cfg.label_norm is None:  # the caller left it to the default
            cfg = dataclasses.replace(cfg, label_norm=default_label_norm(dim, cfg.budget, cfg.label_clip))
        if dim == 0 and not steps_given:  # item biases only: one step (see the note in `_gram_released_once`)
            cfg = dataclasses.replace(cfg, steps=1)
        if dim == 0 and (not steps_given or _gram_released_once(cfg)):
            # the steps or the releases (rank 0: A once) changed: spend exactly ε again
            noise = calibrate_noise(cfg, size_release=noise.size is not None)
    if cfg.count_release is None and cfg.parsed_method.optional_counts:
        cfg = dataclasses.replace(cfg, count_release=counts_useful(cfg, noise, n_users, n_items, per_user))
        if not cfg.count_release:
            noise = calibrate_noise(cfg, size_release=noise.size is not None)  # no count release: all of ε to the item update
    return RunPlan(cfg, noise, run_releases(cfg, noise))


def released_ratings_per_user(total: float, n_users: int, cfg: AltMinConfig, noise_multiplier: float) -> float:
    """r̄ for the rank rule from the released budget-clipped total (post-processing): the released mean
    lowered by 2 noise stds (an under-estimate picks a smaller rank, the safe side), in [0, k]."""
    lower = (total - 2.0 * noise_multiplier * cfg.budget) / n_users
    return float(min(max(lower, 0.0), cfg.budget))


def candidate_event(cfg: AltMinConfig, n_users: int, n_items: int) -> dp_accounting.DpEvent:
    """The composed dp_accounting event of a private fit with `cfg` on the declared sizes (noise calibrated
    to cfg.epsilon): the composition of the releases its report will list."""
    if not cfg.resolve().private:
        raise ValueError(f"method {cfg.method!r} is the non-private reference: it has no privacy event")
    return plan_run(cfg, n_users, n_items).event()


class _ResolvedItems(NamedTuple):
    """The items of one release whose noisy counts are well resolved, for the empirical-Bayes item-bias priors."""
    ok: np.ndarray           # [items] bool: n̂_i ≥ 4 count noise stds and ≥ 10
    n_hat: np.ndarray        # their released counts n̂_i = Â_i[-1, -1]/γ₀²
    mean: np.ndarray         # their raw means m_i = b̂_i[-1]/(γ₀n̂_i)
    var: np.ndarray          # the raw means' sampling + noise variance v_i = s²/n̂_i + σ_b²/(γ₀n̂_i)²
    count_noise: float       # the counts' noise std


def _resolved_items(count, label_sum, cfg: AltMinConfig, noise_multiplier: float) -> _ResolvedItems:
    clip_x, gy, k, g0 = cfg.item_feature_bound, cfg.label_bound, cfg.budget, cfg.bias_clip
    s2 = _bias_priors(cfg)[0]
    count_noise = noise_multiplier * math.sqrt(k) * clip_x**2 / g0**2
    sum_noise = noise_multiplier * math.sqrt(k) * clip_x * gy / g0  # std of b̂_i[-1]/γ₀
    n_all = np.asarray(count, np.float64) / g0**2
    ok = n_all >= max(10.0, 4 * count_noise)
    n_hat = n_all[ok]
    return _ResolvedItems(ok, n_hat, np.asarray(label_sum, np.float64)[ok] / g0 / n_hat,
                          s2 / n_hat + (sum_noise / n_hat) ** 2, count_noise)


def item_bias_prior(count: np.ndarray, label_sum: np.ndarray, cfg: AltMinConfig, noise_multiplier: float) -> float:
    """Empirical-Bayes item-bias variance τ̂² from ONE item update's released bias statistics (post-processing):
    the released noisy counts n̂_i = Â_i[-1, -1]/γ₀² and label sums b̂_i[-1]/γ₀ give raw item means m_i = b̂/(γ₀n̂)
    with sampling + noise variance v_i = s²/n̂_i + σ_b²/(γ₀n̂_i)²; τ̂² = Σ w_i(m_i² − v_i)/Σ w_i (method of moments,
    w_i = 1/(v_i + τ₀²)², τ₀ the public prior), over items whose count is well resolved (n̂_i ≥ 4 count noise
    stds and ≥ 10), floored at 0. On data without item effects τ̂ → 0 and the released biases shrink to 0;
    with strong item effects the shrinkage relaxes. Falls back to the public prior τ₀² when no item qualifies.
    `fit` uses τ̂² at rank 0 and max(τ̂², τ₀²) with factors (the per-item ridge is one scalar for all of the
    item's coordinates, so a tiny τ̂ would also wipe out its factors)."""
    items, tau0 = _resolved_items(count, label_sum, cfg, noise_multiplier), _bias_priors(cfg)[1]
    if not np.any(items.ok):
        return tau0
    m, v = items.mean, items.var
    w = 1.0 / (v + tau0) ** 2
    return float(max(0.0, np.sum(w * (m**2 - v)) / np.sum(w)))


def item_bias_prior_mean(count: np.ndarray, label_sum: np.ndarray, cfg: AltMinConfig, noise_multiplier: float,
                         n_users: int) -> tuple[np.ndarray | None, float]:
    """`item_bias_mean='popularity'`: an empirical-Bayes item-bias prior c_i ~ N(a + b·x_i, τ̂²) whose mean follows the
    log count, from ONE item update's released bias statistics (post-processing, as `item_bias_prior`).

    Over the well-resolved items (n̂_i ≥ 4 count noise stds and ≥ 10) the raw means m_i = b̂_i/(γ₀n̂_i), of variance
    v_i = s²/n̂_i + σ_b²/(γ₀n̂_i)², are regressed on log n̂_i by weighted least squares (weights 1/(v_i + τ̂²)), with τ̂²
    the moment estimate around the line (as `item_bias_prior` around 0), alternated 5 times. Every item's prior mean
    is the line at x_i = E[log n_i | n̂_i] (the count's posterior under the public scale-free prior up to
    n_users·√k, at most the largest resolved log count), and at most τ̂ beyond the line's values over the resolved
    items: below them the line is a guess. Returns (prior means in rating units [items], τ̂²), or (None, the
    zero-centred τ̂² of `item_bias_prior`) when fewer than 3 items are resolved or their counts span less than a
    factor e^POPULARITY_MIN_LOG_RANGE (small ε: a few of the most popular items, whose slope says nothing about
    the rest of the catalogue)."""
    items, tau0 = _resolved_items(count, label_sum, cfg, noise_multiplier), _bias_priors(cfg)[1]
    n_hat, m, v = items.n_hat, items.mean, items.var
    if n_hat.size < 3 or np.log(n_hat.max() / n_hat.min()) < POPULARITY_MIN_LOG_RANGE:  # no lever arm for a slope
        return None, item_bias_prior(count, label_sum, cfg, noise_multiplier)
    design = np.stack([np.ones_like(n_hat), np.log(n_hat)], 1)
    tau2, moment_w = tau0, 1.0 / (v + tau0) ** 2
    for _ in range(5):
        w = 1.0 / (v + tau2)
        coef = np.linalg.lstsq(design.T @ (w[:, None] * design), design.T @ (w * m), rcond=None)[0]
        tau2 = float(max(0.0, np.sum(moment_w * ((m - design @ coef) ** 2 - v)) / np.sum(moment_w)))
    n_all = np.asarray(count, np.float64) / cfg.bias_clip**2
    x = np.asarray(count_posterior_mean(jnp.asarray(n_all, jnp.float32), items.count_noise,
                                        n_users * math.sqrt(cfg.budget), jnp.log), np.float64)
    fitted = design @ coef
    mean = coef[0] + coef[1] * np.minimum(x, np.log(n_hat.max()))
    return np.clip(mean, fitted.min() - math.sqrt(tau2), fitted.max() + math.sqrt(tau2)), tau2


def item_ridge(cfg: AltMinConfig, noise_multiplier: float, n_users: int,
               tau2: float | None = None) -> tuple[float, np.ndarray | None]:
    """Default (noise-aware) ridge of the private SSP item update, from public quantities and released values only:
    (λ, count_ridge) for `solve_tasks`.

    Factors: λ = reg_scale·2√(d+1)·std(A noise), a multiple of the noise's spectral size (0 at rank 0).
    Item bias: the posterior-mean ridge for c_i ~ N(0, τ²) seen through n_i ratings of residual std s plus
    the b̂ noise (std σ√k·Γx·Γy, Γy the label bound): λ_i = (γ₀²s² + σ²k·Γy²·Γx²·E[1/n_i])/τ², with E[1/n_i] the
    posterior mean of 1/n_i given the item's RELEASED noisy weighted count Â_i[-1, -1]/γ₀² (post-processing;
    `jdp.multitask.ssp.inverse_count`, scale-free prior up to the public bound n_users·√k). Measured on ML-100K
    (ada-dpals, test RMSE, 5 seeds): plugging the count in as is (1/n̂) beats a 2-std lower bound at ε ≥ 1
    (1.0275 / 0.9869 / 0.9623 vs 1.0350 / 0.9934 / 0.9645 at ε = 1 / 5 / 20) but loses to the zero-cost model at
    ε ≤ 0.2 (1.0517 vs 1.0445 at ε = 0.05: an item whose count came out high by noise releases noise of size
    ~τ/2 at any ε); the posterior mean keeps both. The scale-free public priors
    s = Γy/2 (residual std) and τ = Γy/4 (item-bias std; on 1–5 stars: 1 and 0.5). Item i gets
    max(λ, λ_i). As σ grows λ_i grows like σ², so the released item biases shrink to 0 and the model
    tends to the zero-cost prior + user bias; rarely rated items shrink most."""
    clip_x, gy, k = cfg.item_feature_bound, cfg.label_bound, cfg.budget
    std_a = noise_multiplier * math.sqrt(k) * clip_x**2
    lam = cfg.reg_scale * 2 * math.sqrt(cfg.dim + int(cfg.biases)) * std_a if cfg.dim > 0 else 0.0
    if not cfg.biases:
        return lam, None
    (s2, tau0), g0 = _bias_priors(cfg), cfg.bias_clip
    tau2 = max(tau2 if tau2 is not None else tau0, 1e-6 * gy**2)  # floor: a finite ridge
    # std of the released count Â_i[-1,-1]/γ₀² at b's noise multiplier. At rank 0 A is released at √2 times that
    # (`bias_gram_noise_ratio`) and the posterior above is then narrower than the release's: measured on ML-100K
    # (ada-dpals, 5 seeds, test RMSE) the release's own std shrank more and lost, 1.0233 → 1.0270 (ε = 1),
    # 0.9756 → 0.9770 (ε = 5), 0.9475 → 0.9479 (ε = 20): the scale-free prior's mass at small counts over-shrinks
    count_noise = noise_multiplier * math.sqrt(k) * clip_x**2 / g0**2
    count_max = n_users * math.sqrt(k)  # a weighted count is at most n_users·max w, and w ≤ √k (Σ_i w_ij² ≤ k)
    count_ridge = np.array([g0**2 * s2 / tau2, noise_multiplier**2 * k * gy**2 * clip_x**2 / tau2, 0.0, g0**2,
                            count_noise, count_max], np.float32)
    return lam, count_ridge


def default_label_norm(dim: int | None, budget: int, label_clip: float) -> float | None:
    """Default per-user label norm bound L of the private SSP item update (`clip_label_norms`), from public values.

    Rank 0 (item biases only, the low signal-to-noise regime `default_dim` picks): L = √k·Γy/2, the norm of k
    residuals at the public residual scale Γy/2, which halves b's sensitivity (√k·Γx·Γy → Γx·L) and shrinks only
    users with many large residuals. With factors (dim > 0: a direction's signal-to-noise ≥ MIN_DIRECTION_SNR) None,
    no per-user bound: there the shrinkage bias costs more than the noise saved. Measured (test RMSE, ada-dpals,
    defaults otherwise): rank 0, ML-100K 1.0106 → 0.9956 at ε = 5 and 0.9706 → 0.9638 at ε = 20 (validation, 2
    splits), ML10M-calibrated synthetic at ε = 1 0.8228 → 0.8150 (1/5 size), 0.8233 → 0.8141 (full size, 2 seeds);
    rank 4, full size, 2 seeds: 0.7975 → 0.8038 at ε = 5, and 0.7653 → 0.7795 at ε = 20 (1 seed).
    None while the rank is unknown (`plan_run` fills it in with the rank)."""
    if dim is None or dim > 0:
        return None
    return 0.5 * math.sqrt(budget) * label_clip


def default_dim(n_users: int, n_items: int, budget: int, noise_multiplier: float, signal_share: float = 1.0,
                ratings_per_user: float | None = None) -> int:
    """Default rank of a private run, from PUBLIC quantities only: the declared sizes (n_users: the user id
    space / a public bound on the users, n_items: the item catalogue; never counts of the users or items
    present in the data), k, σ and the share Γ²/(Γ² + γ₀²) of the feature bound that the factors get, and
    r̄ = ratings_per_user, the users' mean min(n_j, k) (declared or released, `plan_run`; None: k, every user
    spends the whole budget, the largest signal the data could have).

    Each item's noisy Gram has noise of spectral size ≈ 2√d·σ√k·Γx² while its signal per direction is
    ≈ c·Γ²/d for a per-item budget c ≤ min(n_users·r̄/n_items, n_users); so the usable dimension grows
    with x = c·share / (2σ√k), the signal-to-noise ratio of ONE direction. x < MIN_DIRECTION_SNR (4): the
    rank is 0 (item biases only, which then shrink to 0 as the noise grows, so the model tends to the
    zero-cost prior + user bias): a direction must beat the noise by enough to repay the variance of
    fitting it on each user's side. Measured on two data sets (validation RMSE, ada-dpals, biases on):
    ML-100K at ε = 20 (x ≈ 1.6) rank 0 0.980 vs rank 2 1.015; the ML10M-scale MovieLens-calibrated
    synthetic at ε = 1 (x ≈ 2.0) rank 0 0.832 vs 2 / 4 / 8 0.842 / 0.847 / 0.860, and at ε = 5 (x ≈ 6.9)
    rank 0 0.811 vs 2 / 4 / 8 0.788 / 0.791 / 0.808. Above the threshold, theory with a flat
    spectrum gives d ∝ x^(2/3); rating matrices have decaying spectra, and validation RMSE of
    dpals-uniform (two planted power-law sets of 20k and 70k users at ε = 1, 5, 20, and ML-100K at
    ε = 5, 20) followed d ≈ 2·x^(1/3), rounded to a power of two and kept in [2, 32]. Too large a d costs
    far more than too small a d (ML10M-scale synthetic, validation RMSE: ε = 20 d = 32 0.834 vs d = 8
    0.708; ε = 5 d = 4 0.775 vs d = 8 0.763).
    """
    if min(n_users, n_items, budget) < 1:
        raise ValueError(f"n_users, n_items and budget must be >= 1, got {n_users}, {n_items}, {budget}")
    check_positive(noise_multiplier, "noise_multiplier")
    if not 0 < signal_share <= 1:
        raise ValueError(f"signal_share must be in (0, 1], got {signal_share}")
    x = _direction_snr(n_users, n_items, budget, noise_multiplier, signal_share, ratings_per_user)
    if x < MIN_DIRECTION_SNR:
        return 0
    return int(min(32, max(2, 2 ** round(math.log2(2 * x ** (1 / 3))))))


def _direction_snr(n_users: int, n_items: int, budget: int, noise_multiplier: float, signal_share: float,
                   ratings_per_user: float | None = None) -> float:
    """x of `default_dim`: the signal-to-noise ratio of one direction of an item's noisy Gram (public values only)."""
    return signal_share * _mean_item_count(n_users, n_items, budget, ratings_per_user) / (
        2 * noise_multiplier * math.sqrt(budget))


def _mean_item_count(n_users: int, n_items: int, budget: int, ratings_per_user: float | None) -> float:
    """An item's mean budget-limited count implied by the declared sizes and r̄ (None: every user spends k)."""
    per_user = budget if ratings_per_user is None else min(max(ratings_per_user, 0.0), budget)
    return min(n_users * per_user / n_items, float(n_users))


def counts_useful(cfg: AltMinConfig, noise: NoiseMultipliers, n_users: int, n_items: int,
                  ratings_per_user: float | None = None) -> bool:
    """Whether a method with an optional count release (`ada-dpals`, `ada-dpsgd`, `dpsgd-uniform`) releases item
    counts, from PUBLIC quantities and the noise multipliers only (resolved cfg with its final dim and steps). The
    counts steer the weights ω_i = n̂_i^(−μ) only when resolvable: their noise std σ_c·√k (`count_releases`) is below the mean count the
    declared sizes imply, min(n_users·r̄/n_items, n_users) (r̄ as in `default_dim`); noisier counts make ω_i near random while taking
    count_fraction of ε from the item update. Noisy GD also reads them for its per-item step caps
    (`item_step_sizes`), which bind only when the early-stopping step exceeds the cap that is safe without counts
    (every item rated by every user): the only use `dpsgd-uniform` has for them. Without counts every item gets ω_i = 1 (μ = 0: a user's weights
    min(1, √(k/n_j))), and the SSP solve still reads each item's count from its released Gram.
    Measured on ML-100K (validation RMSE, ada-dpals, seeds 0-4, count noise / mean count 5.2 / 2.7 / 1.15 /
    0.61 / 0.33 at ε = 1 / 2 / 5 / 10 / 20): without vs with counts 1.0263 / 1.0068 / 0.9833 / 0.9669 / 0.9565
    vs 1.0320 / 1.0153 / 0.9861 / 0.9663 / 0.9544."""
    resolvable = counts_resolvable(cfg, noise, n_users, n_items, ratings_per_user)
    if cfg.parsed_method.rule == RIDGE:
        return resolvable
    if resolvable and cfg.parsed_method.allocation == "adaptive":  # uniform sampling reads them for the steps only
        return True
    lr, clip_level = _early_stopping_step(cfg, noise, n_users, n_items)
    return lr > SGD_STEP / (clip_level * cfg.item_feature_bound ** 2)  # the cap for ω_i = 1, n_i ≤ n_users


def counts_resolvable(cfg: AltMinConfig, noise: NoiseMultipliers, n_users: int, n_items: int,
                      ratings_per_user: float | None = None) -> bool:
    """Whether released counts can steer the adaptive weights ω_i = n̂_i^(−μ) on their own: their noise std σ_c·√k is
    below the mean count the declared sizes imply (`counts_useful` releases them for the weights alone only then).
    Public quantities and σ only. Counts that noisy GD releases for its step caps below this level reach the
    weights through their posterior (`_weight_counts`): the plug-in n̂ lost there (ML-100K, ε = 2, 5 seeds:
    ada-dpsgd 0.9937 test RMSE with it, 0.9831 with ω_i = 1)."""
    if noise is None or noise.counts is None:
        return False
    return noise.counts * math.sqrt(cfg.budget) < _mean_item_count(n_users, n_items, cfg.budget, ratings_per_user)


def fit(train: Interactions, cfg: AltMinConfig, seed: int | None = None, *, tune: str | None = None,
        valid: Interactions | None = None) -> AltMinModel:
    """Trains with `cfg.method` on `train` and returns the released item matrix and biases and the PrivacyReport.

    `tune="private"`: picks the ridge scale / budget from `jdp.altmin.tuning.public_grid(cfg)` privately
    (`tune_private`: every candidate run and the selection in one report of total cfg.epsilon), scoring
    on `valid` (default: about 10% of the rows of `train`, each row chosen by a keyed hash of its own (user,
    item) pair with the public split seed 0, `jdp.data.split_ratings_by_pair_hash`, so that adding or removing
    a user moves no other user's rows; the candidates are fitted on the other rows). The returned model's
    report covers the whole tuning.

    Unit: a user; relation: add/remove all ratings of one user. `train.n_users` / `train.n_items` are
    used as PUBLIC sizes (user id space, item catalogue; see the module docstring) and recorded as
    assumptions in the report. Duplicate (user, item) rows raise ValueError, for every method, unless
    `cfg.merge_duplicates` (then they are merged into their mean rating first).
    `seed` seeds every noise draw; None (the default) draws fresh OS entropy, recorded in `model.seed`.
    Pass a seed only to reproduce an experiment: whoever knows it can subtract the noise.
    """
    cfg = cfg.for_data(train)
    cfg.resolve()  # validate early
    if cfg.private:  # the one rule (jdp.validation.check_privacy): δ < 1/n of the declared public user id space
        check_privacy(cfg.epsilon, cfg.delta, train.n_users, unit="user")
    if tune is not None:
        return _fit_tuned(train, cfg, seed, tune, valid)
    train = _checked_ratings(train, cfg)
    timings = {}
    t0 = time.perf_counter()
    key, seed = seeded_key(seed)
    k_mean, k_counts, k_weights, k_init, k_train, k_gram = jax.random.split(key, 6)
    n_users, n_items = train.n_users, train.n_items
    report = PrivacyReport(cfg.delta, unit="user", relation=ADD_OR_REMOVE_ONE)
    report.assume(f"public sizes declared by the caller: n_users={n_users} (user id space, a bound on the "
                  f"number of users), n_items={n_items} (item catalogue); not counted from the ratings")
    report.assume(f"public rating scale {tuple(cfg.rating_range)}")
    if cfg.merge_duplicates:
        report.assume("duplicate (user, item) ratings merged into their mean per user before training")

    # Everything private is fixed before any rating is read (the resolved config, the noise multipliers, the
    # releases), except the rank check's choice among plans that all spend the same Gaussian budget
    # (`plan_run`). The report lists exactly the releases the calibration composed.
    plan = plan_run(cfg, n_users, n_items)
    if plan.noise is not None and plan.noise.size is not None:  # the rank check: release the users' sizes, re-plan
        total = private_total_count(jax.random.fold_in(key, 7), jnp.asarray(train.user), n_users, cfg.budget,
                                    plan.noise.size)
        per_user = released_ratings_per_user(total, n_users, cfg, plan.noise.size)
        plan = plan_run(cfg, n_users, n_items, released_ratings_per_user=per_user)
        timings["released_ratings_per_user"] = per_user
    cfg, noise = plan.config, plan.noise
    for release in plan.releases:
        report.add_release(release)
    if cfg.parsed_method.optional_counts and not cfg.releases_counts:
        report.assume("adaptive weights without item counts (counts_useful: of no use at this noise): ω_i = 1"
                      if cfg.parsed_method.allocation == "adaptive" else
                      "noisy-GD step caps without item counts (counts_useful: of no use at this noise)")

    # Pre-processing: the global mean μ and the budget allocation (weights with Σ_i w_ij² ≤ k per user).
    mean = _global_mean(train, cfg, noise, k_mean, report)
    weights, counts = _allocation_weights(train, cfg, noise, k_counts, k_weights)
    timings["preprocess_seconds"] = time.perf_counter() - t0

    # Alternating minimization. Item side: tasks = items, features x_j = [clip(u_j, Γ), γ₀] of the users
    # (‖x_j‖ ≤ item_feature_bound), labels y_ij = clip(r_ij − μ − b_j, Γy), θ_i = [v_i, c_i / γ₀].
    t1 = time.perf_counter()
    update_class = _NoisyGDItemUpdate if cfg.parsed_method.rule == NOISY_GD else _RidgeItemUpdate
    item_update = update_class(train, weights, cfg, noise, timings, counts, gram_key=k_gram)
    timings["plan_seconds"] = time.perf_counter() - t1
    d = cfg.dim
    v = cfg.init_scale * standard_normal(k_init, (n_items, d))
    c = jnp.zeros(n_items, jnp.float32)
    user_solver = UserSolver.for_config(train, cfg)
    user, rating = jnp.asarray(train.user), jnp.asarray(train.rating, jnp.float32)
    step_seconds = []
    for t in tqdm(range(cfg.steps), desc=f"{cfg.method}", disable=not cfg.show_progress, leave=False):
        ts = time.perf_counter()
        users = user_solver(v, c, mean)  # each user's exact solve from the release and own ratings: free
        feats = item_update_features(users.factors, cfg)
        labels = _residuals(rating, user, users.bias, mean, cfg.label_clip if cfg.private else math.inf)
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
    timings["train_seconds"] = time.perf_counter() - t0
    sigma = None if noise is None else noise.training
    return AltMinModel(np.asarray(v), np.asarray(c), float(mean), cfg, report, sigma, timings, seed)


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
        mid, half = _mean_bounds(cfg)
        return mid + private_mean(key, jnp.asarray(train.user), jnp.asarray(train.rating - mid), half, cfg.budget,
                                  noise.mean)
    mean = _prior(cfg)
    report.assume(f"global mean = public prior {mean:g} (no ε spent)")
    return mean


def _allocation_weights(train: Interactions, cfg: AltMinConfig, noise: NoiseMultipliers | None,
                        k_counts: jax.Array, k_weights: jax.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """(each rating's weight in the item update, the released item counts or None). Private methods keep
    Σ_i w_ij² ≤ k for every user (checked). Tail sampling and adaptive weights read the private item counts
    when `cfg.releases_counts` (their release is in the plan). dpsgd-tail returns the released counts of the
    ratings its sample kept (`_releases_kept_counts`) for its step caps."""
    method, k = cfg.parsed_method, cfg.budget
    if not method.private:
        return np.ones(train.nnz, np.float32), None
    user, item = jnp.asarray(train.user), jnp.asarray(train.item)
    counts = private_counts(k_counts, user, item, train.n_items, k, noise.counts).counts if cfg.releases_counts else None
    if method.allocation == "uniform":
        weights = uniform_sampling_weights(k_weights, user, k)
    elif method.allocation == "tail":
        weights = tail_sampling_weights(k_weights, user, item, counts, k)
        if _releases_kept_counts(cfg):  # the kept ratings: ≤ k distinct items per user, sensitivity √k as above
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


class _RidgeItemUpdate:
    """Item update by one ridge solve per item of its statistics A_i = Σ_j w_ij x_j x_jᵀ, b_i = Σ_j w_ij y_ij x_j:
    perturbed at the SSP release's noise scales when private (`dpals-*`, `ada-dpals`), exact for 'als'. The
    observation layout is built once; items are sharded across devices (`cfg.n_shards`)."""

    def __init__(self, train: Interactions, weights: np.ndarray, cfg: AltMinConfig, noise: NoiseMultipliers | None,
                 timings: dict, counts: np.ndarray | None = None, gram_key: jax.Array | None = None):
        self.cfg, self.timings = cfg, timings
        # rank 0: A is released once (`_gram_released_once`): every step draws A's noise from gram_key
        self.gram_key = gram_key if _gram_released_once(cfg) else None
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
            release_a, release_b = _item_update_releases(cfg, self.sigma)  # the noise drawn is the noise recorded
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
            return _rows(theta, self.flat_index)
        stats = np.asarray(_rows(theta, self.flat_index))[:, -2:]
        if self.gram_key is not None:  # A released once: every step must see the first step's noisy Â bit for bit
            if self.released_count is None:
                self.released_count = stats[:, 0].copy()
            elif not np.array_equal(stats[:, 0], self.released_count):
                raise RuntimeError("the rank-0 Gram changed between steps: its single release would not cover it")
        if not self.empirical_bayes:
            return _rows(theta, self.flat_index)[:, :-2]
        # empirical-Bayes prior from this release's bias statistics, then the same release (same key, same
        # noise) solved again with it: post-processing. The ridge carries over to the next step's first solve.
        if self.cfg.item_bias_mean == "popularity" and self.cfg.dim == 0:
            mean, tau2 = item_bias_prior_mean(stats[:, 0], stats[:, 1], self.cfg, self.sigma, self.n_users)
        else:
            mean, tau2 = None, item_bias_prior(stats[:, 0], stats[:, 1], self.cfg, self.sigma)
        if self.cfg.dim > 0:  # one scalar ridge per item also shrinks its factors: never below the public prior's
            tau2 = max(tau2, _bias_priors(self.cfg)[1])
        self.lam, self.count_ridge = item_ridge(self.cfg, self.sigma, self.n_users, tau2)
        theta = self._solve(feats, classes, key, None if mean is None else mean / self.cfg.bias_clip)
        self.timings.setdefault("item_bias_prior_std", []).append(math.sqrt(tau2))
        if mean is not None:
            self.timings.setdefault("item_bias_prior_mean_range", []).append([float(mean.min()), float(mean.max())])
        return _rows(theta, self.flat_index)[:, :-2]  # without the two statistics columns

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
    θ_i = [v_i, c_i / γ₀]; every user's total gradient is clipped to `sgd_clip`."""

    def __init__(self, train: Interactions, weights: np.ndarray, cfg: AltMinConfig, noise: NoiseMultipliers,
                 timings: dict, counts: np.ndarray | None = None, gram_key: jax.Array | None = None):
        self.cfg, self.sgd = cfg, _noisy_gd_config(cfg, noise.training)  # gram_key: unused (no Gram released)
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


SGD_STEP = 1.0  # item_step_sizes: at most one Newton step (at the typical clip factor) per noisy-GD update


def adaptive_item_weights(counts: np.ndarray, cfg: AltMinConfig, n_users: int) -> np.ndarray:
    """ω_i (eq. 16) from the released counts: every weight of item i is ≤ ω_i (post-processing)."""
    return np.asarray(task_weights(jnp.asarray(counts), cfg.mu, n_users, float(cfg.budget)))


def item_step_sizes(cfg: AltMinConfig, noise: NoiseMultipliers, counts: np.ndarray | None, n_users: int,
                    n_items: int, omega: np.ndarray | None = None) -> np.ndarray:
    """Per-item step sizes of the noisy-GD item update (default `sgd_lr=None`), from public quantities and the
    released counts only (post-processing: the steps scale the noisy gradient sum, its sensitivity is unchanged).

    Objective (1/n)·Σ_j s_j Σ_i w_ij ½(θ_i·x_j − y_ij)², n = n_users, s_j ≤ 1 user j's clip factor, whose
    typical value s̄ = min(1, C/(X·s·√k)) is that of a user with k residuals of size s (public: the clip C, the
    feature bound X, the budget k, the residual scale s = Γy/2). Two rules, the smaller step wins:
    - Early stopping as the ridge: from θ = 0, T steps of size η on an item of curvature h ≪ 1/(Tη) give the ridge
      solution with pseudo-count n₀ = n/(T·η·s̄·γ₀²). η is set so that n₀ is the item-bias posterior's
      (c_i ~ N(0, τ²), residual variance s²) plus the gradient noise: σC/n per step, in units of the data term a
      label-sum noise of variance V = (σC/(s̄·γ₀))², spread over the mean public count n̄ = n·k/m:
      n₀ = (s² + V/n̄)/τ². As σ grows n₀ grows like σ², the steps shrink and the released biases stay near 0
      (the zero-cost model).
    - No overshoot: item i's curvature is ≈ s̄·X²·ω_i·n_i/n (w_ij ≤ ω_i: 1 for sampling, eq. 16 for adaptive
      weights; n_i bounded by the released count + COUNT_UCB noise stds, or by n_users without counts), and the
      step is at most SGD_STEP (one Newton step at the typical clip factor) over it. Without counts
      (`count_release` False or resolved so by `counts_useful`) every item gets the step that is safe for an item
      rated by everyone.
    Measured (ML-100K, validation RMSE, ada-dpsgd, 2 splits): ε = 5 0.977 and ε = 20 0.957 with these steps,
    vs 1.04 with the former global step 0.5 (the biases barely moved) and 0.978 with a hand-picked global 64.
    """
    x2, k = cfg.item_feature_bound ** 2, cfg.budget
    lr, clip_level = _early_stopping_step(cfg, noise, n_users, n_items)
    w = np.ones(n_items) if omega is None else np.asarray(omega, np.float64)
    n_hi = (np.full(n_items, float(n_users)) if counts is None
            else np.minimum(np.asarray(counts, np.float64) + COUNT_UCB * noise.counts * math.sqrt(k), n_users))
    return np.minimum(lr, SGD_STEP * n_users / (clip_level * x2 * w * n_hi)).astype(np.float32)


def _early_stopping_step(cfg: AltMinConfig, noise: NoiseMultipliers, n_users: int, n_items: int) -> tuple[float, float]:
    """(the early-stopping step size of `item_step_sizes`, the typical clip factor s̄): public values and σ only."""
    g0, k, clip = cfg.bias_clip, cfg.budget, cfg.sgd_clip
    s2, tau2 = _bias_priors(cfg)
    clip_level = min(1.0, clip / (cfg.item_feature_bound * math.sqrt(s2 * k)))
    mean_count = min(n_users * k / n_items, float(n_users))
    noise_var = (noise.training * clip / (clip_level * g0)) ** 2
    n0 = (s2 + noise_var / mean_count) / tau2
    return n_users / (cfg.sgd_inner_steps * cfg.steps * clip_level * g0**2 * n0), clip_level


def item_update_features(user_factors: jax.Array, cfg: AltMinConfig) -> jax.Array:
    """x_j = [clip(u_j, Γ), γ₀] (private; unclipped for 'als'): ‖x_j‖ ≤ cfg.item_feature_bound, the bound the
    SSP / noisy-GD sensitivity analysis uses. Rank 0 keeps only γ₀; no biases drop it."""
    u = jnp.asarray(user_factors, jnp.float32)
    feats = clip_by_norm(u, cfg.user_clip) if cfg.private else u
    if cfg.biases:
        feats = jnp.concatenate([feats, jnp.full((u.shape[0], 1), cfg.bias_clip, jnp.float32)], axis=1)
    return feats


def _fit_tuned(train: Interactions, cfg: AltMinConfig, seed: int | None, tune: str, valid: Interactions | None):
    from jdp.altmin.tuning import public_grid, tune_private  # tuning builds on fit
    from jdp.data import split_ratings_by_pair_hash
    if tune != "private":
        raise ValueError(f"tune must be None or 'private', got {tune!r}")
    if not cfg.private:
        raise ValueError("tune='private' tunes a private method; 'als' is the non-private reference")
    if valid is None:
        # per-row keyed split: one user's rows never move another user's rows between the parts, so
        # neighbouring inputs stay neighbouring (train, valid) pairs, as tune_private's analysis assumes
        train, valid = split_ratings_by_pair_hash(train, TUNE_VALID_FRACTION, seed=TUNE_SPLIT_SEED)
    tuned = tune_private(train, valid, public_grid(cfg), epsilon=cfg.epsilon, delta=cfg.delta, seed=seed)
    model = tuned.model
    model.report, model.seed = tuned.report, tuned.seed
    model.report.assume(f"rank / ridge chosen privately from a public grid of {len(tuned.configs)} "
                        f"(candidate {tuned.index}: dim={model.config.dim}, reg_scale={model.config.reg_scale:g}, "
                        f"budget={model.config.budget})")
    return model

