"""What a private altmin fit will run and release, fixed from PUBLIC quantities before any rating is read.

`run_releases` is the ONE description of a run's privacy; `calibrate_noise` sets σ so that it spends exactly
(ε, δ); `plan_run` resolves the config on the declared sizes (rank, steps, count release) and returns the
`RunPlan` that `fit` executes and `candidate_event` composes. The defaults that depend on σ and the declared
sizes live here too (`default_dim`, `counts_useful`, `item_ridge`, `item_step_sizes`), with the empirical-Bayes
item-bias priors that post-process one release (`item_bias_prior`, `item_bias_prior_mean`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import dp_accounting
import jax.numpy as jnp
import numpy as np

from jdp.accounting import Release, calibrate
from jdp.altmin.config import NOISY_GD, RIDGE, AltMinConfig, bias_priors, default_label_norm
from jdp.multitask.counts import count_releases, label_sum_releases, total_count_releases
from jdp.multitask.noisy_gd import NoisyGDConfig, noisy_gd_releases
from jdp.multitask.ssp import count_posterior_mean, ssp_releases
from jdp.multitask.weights import task_weights
from jdp.validation import check_positive

COUNT_UCB = 2.0  # item_step_sizes: an item's count is at most its released count + 2 noise stds (no overshoot)
POPULARITY_MIN_LOG_RANGE = 1.0  # item_bias_prior_mean: the resolved counts must span a factor e to fit a slope
MIN_DIRECTION_SNR = 4.0  # default_dim: below this signal-to-noise ratio of one direction, rank 0 (biases only)


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


def mean_bounds(cfg: AltMinConfig) -> tuple[float, float]:
    """(midpoint, half-range) of the public rating scale: the private mean is taken of the ratings shifted by
    the midpoint and clipped to ± the half-range (a smaller sensitivity than the raw ratings have)."""
    lo, hi = cfg.rating_range
    return 0.5 * (lo + hi), 0.5 * (hi - lo)


def _mean_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    return label_sum_releases(mean_bounds(cfg)[1], cfg.budget, sigma, name="global mean")


def _count_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    releases = count_releases(cfg.budget, sigma, name="item counts")
    if releases_kept_counts(cfg):  # both inside count_fraction of ε
        releases += count_releases(cfg.budget, sigma, name=KEPT_COUNTS)
    return releases


KEPT_COUNTS = "item counts of the tail sample"


def releases_kept_counts(cfg: AltMinConfig) -> bool:
    """dpsgd-tail: a second count release, of the ratings the tail sample kept, for the noisy-GD step caps. The raw
    counts choose the sample but bound a popular item's kept ratings loosely (a user keeps their k least popular
    items), so caps from them held popular items still: on the ML10M-scale synthetic (2 splits) dpsgd-tail reached
    0.841 / 0.847 test RMSE at ε = 1 / 5 with them, 0.818 with the kept counts at √2 their noise."""
    method = cfg.parsed_method
    return method.allocation == "tail" and method.rule == NOISY_GD


def _size_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    return total_count_releases(cfg.budget, sigma, name="ratings per user (budget-clipped total)")


def noisy_gd_config(cfg: AltMinConfig, sigma: float) -> NoisyGDConfig:
    """One noisy-GD item update: `sgd_inner_steps` steps with clip C, step size and the public ridge of `cfg`
    (sgd_lr=None: the 1.0 here is a placeholder, `_NoisyGDItemUpdate` passes the per-item `item_step_sizes`)."""
    return NoisyGDConfig(cfg.l2_clip, sigma, cfg.sgd_inner_steps, cfg.sgd_lr or 1.0,
                         lam=cfg.reg if cfg.reg is not None else 0.0, sample_rate=cfg.sample_rate)


def item_update_releases(cfg: AltMinConfig, sigma: float) -> list[Release]:
    """The releases of the cfg.steps private item updates: SSP's A and b (features ‖x_j‖ ≤ item_feature_bound,
    labels |y| ≤ Γy, Σ_i w_ij² ≤ k), or one noisy-GD step per inner update."""
    if cfg.parsed_method.rule == NOISY_GD:
        return noisy_gd_releases(noisy_gd_config(cfg, sigma), count=cfg.steps, prefix="item update (noisy GD)")
    once = gram_released_once(cfg)
    return ssp_releases(sigma, float(cfg.budget), cfg.item_feature_bound, cfg.label_bound, count=cfg.steps,
                        prefix="item update (SSP)", gram_count=1 if once else None,
                        gram_noise_ratio=bias_gram_noise_ratio(cfg) if once else 1.0)


def gram_released_once(cfg: AltMinConfig) -> bool:
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
    For an item bias of the public prior size τ₀ (`bias_priors`) the minimum is at σ_A/σ_b = √(Γb/τ₀): √2 with
    the default label bound Γy/2 and τ₀ = Γy/4. Measured on ML-100K (ada-dpals, test RMSE, seeds 0-4, one step,
    A released once): ratio 1 / √2 / 2 gave 1.0341 / 1.0312 / 1.0313 at ε = 1, 0.9902 / 0.9874 / 0.9864 at ε = 5."""
    return math.sqrt(cfg.label_bound / math.sqrt(bias_priors(cfg)[1]))


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
    return releases + item_update_releases(cfg, noise.training)


def calibrate_noise(cfg: AltMinConfig, size_release: bool = False,
                    calibrated: NoiseMultipliers | None = None) -> NoiseMultipliers:
    """The noise multipliers of a private run with the resolved `cfg`: the pre-processing ones so that each part
    alone spends its fraction of ε (center_fraction for the mean, count_fraction for the counts, size_fraction
    for the rank check's total when `size_release`); then the training σ by root finding so that all of
    `run_releases` composed spends exactly (ε, δ).

    Calibrated once: `calibrated`, the multipliers of an earlier branch of the same run (`plan_run`), gives the
    pre-processing σ's it has; they depend only on ε, δ, the fractions, the budget and the rating scale, which no
    branch changes, so only the missing ones and the training σ are calibrated. The result is cached per
    (cfg, size_release, calibrated) (public values only): a re-plan (`fit`'s after the rank check) does not
    calibrate again what it planned first."""
    if not cfg.private:
        raise ValueError(f"method {cfg.method!r} is the non-private reference: it has no noise to calibrate")
    return _calibrate_noise(cfg, bool(size_release), calibrated)


@functools.lru_cache(maxsize=256)
def _calibrate_noise(cfg: AltMinConfig, size_release: bool, calibrated: NoiseMultipliers | None) -> NoiseMultipliers:
    def sigma_spending(epsilon: float, releases_at) -> float:
        return calibrate(lambda s: _composed(releases_at(s)), epsilon, cfg.delta, bracket=(1e-2, 1e7))

    def part(known: float | None, fraction: float, releases_at) -> float:
        return known if known is not None else sigma_spending(fraction * cfg.epsilon, releases_at)

    known = calibrated or NoiseMultipliers(None, None, math.nan)
    sigma_mean = sigma_counts = sigma_size = None
    if size_release:
        sigma_size = part(known.size, cfg.size_fraction, lambda s: _size_releases(cfg, s))
    if cfg.global_mean == "private":
        sigma_mean = part(known.mean, cfg.center_fraction, lambda s: _mean_releases(cfg, s))
    if cfg.releases_counts:
        sigma_counts = part(known.counts, cfg.count_fraction, lambda s: _count_releases(cfg, s))
    sigma = sigma_spending(cfg.epsilon,
                           lambda s: run_releases(cfg, NoiseMultipliers(sigma_mean, sigma_counts, s, sigma_size)))
    return NoiseMultipliers(sigma_mean, sigma_counts, sigma, sigma_size)


def plan_run(cfg: AltMinConfig, n_users: int, n_items: int, released_ratings_per_user: float | None = None, *,
             resolved: AltMinConfig | None = None) -> RunPlan:
    """The plan of a fit with `cfg` on the declared PUBLIC sizes: the resolved config (dim and steps filled in),
    its noise multipliers and its releases; `fit` and `candidate_event` both use it, so the accounted event is
    the one that runs. An unset dim comes from `default_dim`; when that is 0 (biases only) and steps were not
    set, one step is taken (see `gram_released_once`) and σ is recalibrated.
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
    0.99-1.16 vs 0.84-0.87).
    `resolved`: `cfg.resolve()` where the caller has it (`fit` validates the config once, before any work)."""
    steps_given = cfg.steps is not None
    cfg = cfg.resolve() if resolved is None else resolved
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
            noise = calibrate_noise(cfg, size_release=True, calibrated=noise)
            per_user = cfg.budget if released_ratings_per_user is None else released_ratings_per_user
            dim = max(default_dim(n_users, n_items, cfg.budget, noise.training, share, per_user), 0 if cfg.biases else 1)
        cfg = dataclasses.replace(cfg, dim=dim)
        if cfg.parsed_method.rule == RIDGE and cfg.label_norm is None:  # the caller left it to the default
            cfg = dataclasses.replace(cfg, label_norm=default_label_norm(dim, cfg.budget, cfg.label_clip))
        if dim == 0 and not steps_given:  # item biases only: one step (see the note in `gram_released_once`)
            cfg = dataclasses.replace(cfg, steps=1)
        if dim == 0 and (not steps_given or gram_released_once(cfg)):
            # the steps or the releases (rank 0: A once) changed: spend exactly ε again
            noise = calibrate_noise(cfg, size_release=noise.size is not None, calibrated=noise)
    if cfg.count_release is None and cfg.parsed_method.optional_counts:
        cfg = dataclasses.replace(cfg, count_release=counts_useful(cfg, noise, n_users, n_items, per_user))
        if not cfg.count_release:
            # no count release: all of ε to the item update
            noise = calibrate_noise(cfg, size_release=noise.size is not None, calibrated=noise)
    return RunPlan(cfg, noise, run_releases(cfg, noise))


def released_ratings_per_user(total: float, n_users: int, cfg: AltMinConfig, noise_multiplier: float) -> float:
    """r̄ for the rank rule from the released budget-clipped total (post-processing): the released mean
    lowered by 2 noise stds (an under-estimate picks a smaller rank, the safe side), in [0, k]."""
    lower = (total - 2.0 * noise_multiplier * cfg.budget) / n_users
    return float(min(max(lower, 0.0), cfg.budget))


def candidate_event(cfg: AltMinConfig, n_users: int, n_items: int) -> dp_accounting.DpEvent:
    """The composed dp_accounting event of a private fit with `cfg` on the declared sizes (noise calibrated
    to cfg.epsilon): the composition of the releases its report will list."""
    resolved = cfg.resolve()
    if not resolved.private:
        raise ValueError(f"method {cfg.method!r} is the non-private reference: it has no privacy event")
    return plan_run(cfg, n_users, n_items, resolved=resolved).event()


class _ResolvedItems(NamedTuple):
    """The items of one release whose noisy counts are well resolved, for the empirical-Bayes item-bias priors."""
    ok: np.ndarray           # [items] bool: n̂_i ≥ 4 count noise stds and ≥ 10
    n_hat: np.ndarray        # their released counts n̂_i = Â_i[-1, -1]/γ₀²
    mean: np.ndarray         # their raw means m_i = b̂_i[-1]/(γ₀n̂_i)
    var: np.ndarray          # the raw means' sampling + noise variance v_i = s²/n̂_i + σ_b²/(γ₀n̂_i)²
    count_noise: float       # the counts' noise std


def _resolved_items(count, label_sum, cfg: AltMinConfig, noise_multiplier: float) -> _ResolvedItems:
    clip_x, gy, k, g0 = cfg.item_feature_bound, cfg.label_bound, cfg.budget, cfg.bias_clip
    s2 = bias_priors(cfg)[0]
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
    items, tau0 = _resolved_items(count, label_sum, cfg, noise_multiplier), bias_priors(cfg)[1]
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
    items, tau0 = _resolved_items(count, label_sum, cfg, noise_multiplier), bias_priors(cfg)[1]
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
    (s2, tau0), g0 = bias_priors(cfg), cfg.bias_clip
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
    g0, k, clip = cfg.bias_clip, cfg.budget, cfg.l2_clip
    s2, tau2 = bias_priors(cfg)
    clip_level = min(1.0, clip / (cfg.item_feature_bound * math.sqrt(s2 * k)))
    mean_count = min(n_users * k / n_items, float(n_users))
    noise_var = (noise.training * clip / (clip_level * g0)) ** 2
    n0 = (s2 + noise_var / mean_count) / tau2
    return n_users / (cfg.sgd_inner_steps * cfg.steps * clip_level * g0**2 * n0), clip_level
