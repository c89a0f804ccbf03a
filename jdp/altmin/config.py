"""What an altmin run is asked to do: the method names (`Method`, one table) and the hyper-parameters
(`AltMinConfig`, validated and completed once by `resolve()` from public quantities only).

The privacy statement of the family is in `jdp.altmin.train`; the plan a config turns into (noise, releases,
defaults that depend on the declared sizes) in `jdp.altmin.plan`.
"""
from __future__ import annotations

import dataclasses
import math

from jdp.data import Interactions
from jdp.validation import check_positive, check_privacy, renamed_keywords

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


DEFAULT_RATING_RANGE = (0.5, 5.0)  # the public scale when neither the config nor the data declare one


def bias_priors(cfg: "AltMinConfig") -> tuple[float, float]:
    """(s², τ₀²): the public residual variance (Γy/2)² and item-bias prior variance (Γy/4)² (1 and 0.25 on 1–5 stars)."""
    return (cfg.label_clip / 2) ** 2, (cfg.label_clip / 4) ** 2


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



@renamed_keywords(sgd_clip="l2_clip")  # the old name works until the next release, with a DeprecationWarning
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
    rating_range: tuple[float, float] | None = None  # PUBLIC rating scale; None: the data's declared scale
                                         # (Interactions.rating_range, e.g. load_movielens'), else DEFAULT_RATING_RANGE
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
    l2_clip: float = 1.0                 # C: per-user L2 clip of the noisy-GD gradient (dpsgd-*; was sgd_clip)
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
        """This config for `data`: a rating_range left at None becomes the scale the data declare (else the default)."""
        if self.rating_range is not None:
            return self
        declared = getattr(data, "rating_range", None)
        return dataclasses.replace(self, rating_range=self.scale if declared is None else tuple(declared))

    @property
    def scale(self) -> tuple[float, float]:
        """The public rating scale: `rating_range`, or DEFAULT_RATING_RANGE while it is left at None."""
        return DEFAULT_RATING_RANGE if self.rating_range is None else tuple(self.rating_range)

    @property
    def parsed_method(self) -> Method:
        """`method` as (update rule, budget allocation); ValueError for an unknown name."""
        return Method.parse(self.method)

    @property
    def private(self) -> bool:
        return self.parsed_method.private

    def _check_fields(self, n_users: int | None) -> None:
        """The checks of fields that have no default to resolve (ValueError naming the field)."""
        Method.parse(self.method)
        lo, hi = self.scale
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
            raise ValueError(f"rating_range must be finite with hi > lo, got {self.rating_range}")
        if self.private:  # the one privacy rule (δ < 1/n where n is known)
            check_privacy(self.epsilon, self.delta, n_users, unit="user")
        else:  # the non-private reference states no guarantee: δ need only be a number in (0, 1)
            check_privacy(None, self.delta, None, unit="user")
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
        if self.item_bias_mean not in ("zero", "popularity"):  # read by the private SSP methods' default ridge
            raise ValueError(f"item_bias_mean must be 'zero' or 'popularity', got {self.item_bias_mean!r}")

    def resolve(self, n_users: int | None = None) -> "AltMinConfig":
        """Validates every field once and fills in the documented defaults (dim stays None for a private method:
        `plan_run` picks it); the result's `rating_range` is concrete. `n_users`: the declared public number of
        users where it is known (`fit`: train.n_users), for the privacy rule's δ < 1/n (`check_privacy`, which a
        private config calls here once)."""
        self._check_fields(n_users)
        lo, hi = self.scale
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
                                   global_mean=global_mean, rating_range=(lo, hi),
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
