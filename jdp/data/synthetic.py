"""Synthetic long-tailed data: the appendix-C multi-task regression data and planted low-rank
rating matrices at MovieLens scale (Zipf popularity, or calibrated to MovieLens).

Data generators, not private routines: nothing is released. Generation uses numpy's Generator
(seeded) on the host and is vectorised (no per-user or per-item Python loops). Their `seed` (default
0, so experiments stay comparable) is public randomness of the generated data, never privacy noise:
private routines draw their noise from their own key or fresh OS entropy (`jdp.noise.seeded_key`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jdp.data.interactions import Interactions


@dataclasses.dataclass(frozen=True, eq=False)
class SyntheticTasks:
    """Generated data with its ground truth.

    data:          Interactions (user = j, item = task / item i, rating = label y_ij)
    user_factors:  float32 [n_users, dim]  (features u_j / planted user factors)
    task_params:   float32 [n_items, dim]  (θ_i / planted item factors)
    popularity:    float64 [n_items]       (inclusion probability q_i for appendix C; sampling
                                            probability p_i, summing to 1, for planted_powerlaw
                                            and planted_movielens)
    offset:        constant added to every noise-free label (global mean; 0 for appendix C)
    noise_std:     std of the label noise
    """

    data: Interactions
    user_factors: np.ndarray
    task_params: np.ndarray
    popularity: np.ndarray
    offset: float = 0.0
    noise_std: float = 0.0

    def expected_rating(self, user: np.ndarray, item: np.ndarray) -> np.ndarray:
        """Noise-free label offset + <u_user, θ_item> (before any clipping), float32 [len(user)]."""
        u = np.asarray(user)
        i = np.asarray(item)
        return (self.offset + np.einsum("nd,nd->n", self.user_factors[u], self.task_params[i])).astype(np.float32)


def _pos_int(name: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _pos_float(name: str, v, allow_zero: bool = False) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if not np.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'} and finite, got {v!r}")
    return f


def _unit_ball(x: np.ndarray) -> np.ndarray:
    # Projection onto the unit ball: x / max(1, ||x||).
    return x / np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))


def appendix_c(seed: int = 0, n_users: int = 10_000, n_tasks: int = 100, dim: int = 5, a: float = 1.0,
               total_popularity: float = 20.0, label_noise: float = 1e-3) -> SyntheticTasks:
    """Appendix-C synthetic multi-task linear regression (Krichene et al., ICML 2023).

    u_j, θ_i ~ N(0, I_dim) projected onto the unit ball; task popularity q_i = U_i^(1/a)
    (pdf ∝ a·x^(a−1) on [0, 1], numpy's `power(a)`), rescaled to sum to `total_popularity` and
    clipped to <= 1 (clipping only happens for extreme draws; then the sum is slightly lower);
    (i, j) ∈ Ω independently with probability q_i; y_ij = <u_j, θ_i> + N(0, label_noise²)
    (the paper's σ_F = 1e-3). In expectation each user has total_popularity tasks and task i has
    q_i·n_users users. Memory O(n_users·n_tasks) booleans. Split with
    `split_ratings(data, (0.8, 0.2), seed)` for the paper's 80/20 protocol.
    """
    n_users, n_tasks, dim = _pos_int("n_users", n_users), _pos_int("n_tasks", n_tasks), _pos_int("dim", dim)
    a = _pos_float("a", a)
    total_popularity = _pos_float("total_popularity", total_popularity)
    label_noise = _pos_float("label_noise", label_noise, allow_zero=True)
    if seed is None or isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    u = _unit_ball(rng.standard_normal((n_users, dim)))
    theta = _unit_ball(rng.standard_normal((n_tasks, dim)))
    q = rng.random(n_tasks) ** (1.0 / a)
    q = np.minimum(q * (total_popularity / q.sum()), 1.0)
    mask = rng.random((n_users, n_tasks)) < q[None, :]
    user, item = np.nonzero(mask)  # user-major order
    y = np.einsum("nd,nd->n", u[user], theta[item]) + label_noise * rng.standard_normal(user.size)
    data = Interactions(user.astype(np.int32), item.astype(np.int32), y.astype(np.float32), n_users, n_tasks)
    return SyntheticTasks(data, u.astype(np.float32), theta.astype(np.float32), q, 0.0, label_noise)


def _zipf_probs(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """p ∝ rank^(−exponent) with the ranks assigned to ids by a random permutation."""
    p = np.arange(1, n + 1, dtype=np.float64) ** (-exponent)
    p /= p.sum()
    return p[rng.permutation(n)]


def _sample_codes(rng: np.random.Generator, p: np.ndarray, size: int) -> np.ndarray:
    """`size` iid draws from the categorical distribution p (inverse CDF), int64."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), p.size - 1).astype(np.int64)


def _merge_unique(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct values of two sorted int64 arrays (stable sort = timsort merges the two runs)."""
    c = np.concatenate([a, b])
    c.sort(kind="stable")
    keep = np.ones(c.size, dtype=np.bool_)
    np.not_equal(c[1:], c[:-1], out=keep[1:])
    return c[keep]


def _sample_pairs(rng: np.random.Generator, p_user: np.ndarray, p_item: np.ndarray, nnz: int,
                  max_rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """`nnz` distinct (user, item) pairs drawn iid from p_user ⊗ p_item, sorted by (user, item).

    Pair code = user·n_items + item (int64). Top up in rounds, scaling each draw by the observed
    fraction of new distinct pairs so that saturated head pairs do not stall the loop; then trim
    uniformly at random to exactly `nnz` (fewer if `max_rounds` did not reach it)."""
    n_items = p_item.size
    codes = np.empty(0, dtype=np.int64)
    draw = nnz
    for _ in range(max_rounds):
        new = _sample_codes(rng, p_user, draw) * n_items + _sample_codes(rng, p_item, draw)
        new.sort()
        before = codes.size
        codes = _merge_unique(codes, new)
        if codes.size >= nnz:
            break
        gained = max(codes.size - before, 1)
        draw = int(min(8 * nnz, np.ceil((nnz - codes.size) * draw / gained * 1.05)) + 1000)
    if codes.size > nnz:
        keep = np.sort(rng.choice(codes.size, size=nnz, replace=False))
        codes = codes[keep]
    return (codes // n_items).astype(np.int32), (codes % n_items).astype(np.int32)


def _planted_factors(rng: np.random.Generator, n_users: int, n_items: int, rank: int, spectrum_decay: float,
                     variance: float) -> tuple[np.ndarray, np.ndarray]:
    """User / item factors whose products <u_j, v_i> have variance `variance`, factor k carrying a
    share ∝ (k+1)^(−spectrum_decay) of it (a decaying spectrum like real rating matrices)."""
    share = np.arange(1, rank + 1, dtype=np.float64) ** (-spectrum_decay)
    scale = np.sqrt(np.sqrt(variance * share / share.sum()))  # per-factor std: product variances sum to `variance`
    uf = (scale * rng.standard_normal((n_users, rank))).astype(np.float32)
    vf = (scale * rng.standard_normal((n_items, rank))).astype(np.float32)
    return uf, vf


def _planted_ratings(rng: np.random.Generator, user: np.ndarray, item: np.ndarray, uf: np.ndarray,
                     vf: np.ndarray, mean: float, noise_std: float, lo: float, hi: float) -> np.ndarray:
    """mean + <uf_user, vf_item> + N(0, noise_std²), clipped to [lo, hi], float32."""
    rating = np.empty(user.size, dtype=np.float32)
    chunk = 1 << 20  # bounded memory: gathers of [chunk, rank] at a time
    for s in range(0, user.size, chunk):
        e = min(s + chunk, user.size)
        rating[s:e] = np.einsum("nd,nd->n", uf[user[s:e]], vf[item[s:e]])
    rating += (mean + noise_std * rng.standard_normal(user.size)).astype(np.float32)
    np.clip(rating, lo, hi, out=rating)
    return rating


def _check_planted(seed, n_users, n_items, nnz, rank, max_rounds, noise_std, spectrum_decay, mean,
                   rating_scale) -> tuple[float, float, float, float]:
    """Validation shared by the planted generators (raises ValueError naming the argument); returns
    (noise_std, spectrum_decay, low, high) as floats."""
    for name, v in (("n_users", n_users), ("n_items", n_items), ("nnz", nnz), ("rank", rank),
                    ("max_rounds", max_rounds)):
        _pos_int(name, v)
    noise_std = _pos_float("noise_std", noise_std, allow_zero=True)
    spectrum_decay = _pos_float("spectrum_decay", spectrum_decay, allow_zero=True)
    lo, hi = (float(x) for x in rating_scale)
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(f"rating_scale must be finite (low, high) with low < high, got {rating_scale!r}")
    if not np.isfinite(mean):
        raise ValueError(f"mean must be finite, got {mean!r}")
    if nnz > n_users * n_items:
        raise ValueError(f"nnz={nnz} exceeds n_users·n_items={n_users * n_items}")
    if seed is None or isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return noise_std, spectrum_decay, lo, hi


def planted_powerlaw(seed: int = 0, n_users: int = 69_878, n_items: int = 10_677, nnz: int = 10_000_000,
                     rank: int = 16, exponent: float = 1.0, noise_std: float = 0.5,
                     rating_scale: tuple[float, float] = (0.5, 5.0), user_activity_exponent: float = 0.5,
                     mean: float = 3.5, max_rounds: int = 12, spectrum_decay: float = 1.0) -> SyntheticTasks:
    """Planted low-rank ratings with long-tailed item popularity and skewed user activity.

    Defaults match ML10M's size (69,878 users, 10,677 items, ~10M ratings); ML20M's size is
    n_users=136_677, n_items=20_108. Item sampling probabilities p_i ∝ rank_i^(−exponent) and
    user activity ∝ rank_j^(−user_activity_exponent) (ranks randomly permuted over ids). Pairs
    (user, item) are drawn iid from the product distribution and de-duplicated, in rounds that top
    up the deficit, then trimmed uniformly at random to exactly `nnz`. Because an item cannot have
    more than n_users ratings, head items saturate (their realised share is below p_i); if the
    target is unreachable within `max_rounds` rounds the result has fewer than `nnz` ratings.

    Ratings = mean + <u_j, v_i> + N(0, noise_std²), clipped to rating_scale, with factor k of u_j
    and v_i ~ N(0, a_k) and a_k ∝ (k+1)^(−spectrum_decay/2): factor k carries a share ∝ (k+1)^(−decay)
    of the signal (a decaying spectrum like real rating matrices; 0 = all factors equal). Σ a_k² = 0.75,
    so the signal has variance 0.75 and (noise_std = 0.5) the rating std is ≈ 1 before clipping,
    like MovieLens. The output is sorted
    by (user, item) and has no duplicate pairs. `popularity` holds p_i.
    """
    noise_std, spectrum_decay, lo, hi = _check_planted(seed, n_users, n_items, nnz, rank, max_rounds, noise_std,
                                                       spectrum_decay, mean, rating_scale)
    exponent = _pos_float("exponent", exponent, allow_zero=True)
    user_activity_exponent = _pos_float("user_activity_exponent", user_activity_exponent, allow_zero=True)
    rng = np.random.default_rng(seed)
    p_item = _zipf_probs(rng, n_items, exponent)
    p_user = _zipf_probs(rng, n_users, user_activity_exponent)
    user, item = _sample_pairs(rng, p_user, p_item, nnz, max_rounds)
    uf, vf = _planted_factors(rng, n_users, n_items, rank, spectrum_decay, 0.75)
    rating = _planted_ratings(rng, user, item, uf, vf, mean, noise_std, lo, hi)
    data = Interactions(user, item, rating, n_users, n_items)
    return SyntheticTasks(data, uf, vf, p_item, float(mean), noise_std)


# Calibration of planted_movielens.
# Marginals: published scipy `lognorm` fits (s, loc, scale) to MovieLens-10M's ratings per item
# (median ≈ 141, ~10% of the items below 10 ratings, item Gini 0.805) and per user (each ≥ 20,
# median ≈ 67), from LensKit's data description of ML10M.
ML10M_ITEM_LOGNORMAL = (2.121, 0.711, 140.0)
ML10M_USER_LOGNORMAL = (1.599, 18.486, 48.806)


def _lognormal_probs(rng: np.random.Generator, n: int, fit: tuple[float, float, float]) -> np.ndarray:
    """p ∝ the n mid-quantiles of a shifted log-normal, assigned to ids by a random permutation.
    Quantiles rather than draws: the shape is the fit's, not one sample's extremes."""
    from scipy.stats import lognorm

    s, loc, scale = fit
    p = lognorm.ppf((np.arange(n, dtype=np.float64) + 0.5) / n, s, loc=loc, scale=scale)
    p /= p.sum()
    return p[rng.permutation(n)]


def planted_movielens(seed: int = 0, n_users: int = 69_878, n_items: int = 10_677, nnz: int = 10_000_000,
                      rank: int = 16, item_bias_std: float = 0.5, popularity_bias_corr: float = 0.4,
                      user_bias_std: float = 0.4, interaction_variance: float = 0.25, noise_std: float = 0.7,
                      rating_scale: tuple[float, float] = (0.5, 5.0), mean: float = 3.25, max_rounds: int = 12,
                      spectrum_decay: float = 1.0) -> SyntheticTasks:
    """Planted ratings calibrated to MovieLens: its marginals, biases and variance split.

    planted_powerlaw's Zipf marginals give every item ≥ ~100 ratings at ML10M size and have no
    biases; real MovieLens has a long tail of items with a handful of ratings, and much of its
    explainable variance is item and user biases, with popular movies rated higher. Here:
      - pairs: iid from p_user ⊗ p_item, de-duplicated (as planted_powerlaw), with p_item and
        p_user ∝ the mid-quantiles of the published log-normal fits to ML10M's ratings-per-item
        and ratings-per-user (ML10M_ITEM_LOGNORMAL, ML10M_USER_LOGNORMAL), rescaled to `nnz`;
      - ratings = mean + b_i + c_j + <u_j, v_i> + N(0, noise_std²), clipped to rating_scale, with
        item bias b_i = item_bias_std·(ρ·z_i + √(1−ρ²)·g_i), z_i the standardised log p_i,
        ρ = popularity_bias_corr, g_i ~ N(0, 1); user bias c_j ~ N(0, user_bias_std²); and rank-`rank`
        interactions of variance `interaction_variance` with a decaying spectrum (planted_powerlaw).
    Defaults: bias sizes and ρ as measured on ML-100K with a ridge bias model (item-bias std ≈ 0.54,
    corr. with log count ≈ 0.4, user-bias std ≈ 0.41); noise_std 0.7 below the reference non-private
    ALS RMSE on ML10M (0.777) and a total rating std ≈ 1.07 before clipping (ML10M ≈ 1.06); mean
    3.25 because popular items carry positive bias, so the mean rating is ≈ 3.5 (ML10M 3.51).

    The biases ride in the returned factors so that `expected_rating` is exact: user_factors =
    [u_j, c_j, 1] and task_params = [v_i, 1, b_i] (rank + 2 columns). Sorted by (user, item), no
    duplicate pairs; `popularity` holds p_i.
    """
    noise_std, spectrum_decay, lo, hi = _check_planted(seed, n_users, n_items, nnz, rank, max_rounds, noise_std,
                                                       spectrum_decay, mean, rating_scale)
    item_bias_std = _pos_float("item_bias_std", item_bias_std, allow_zero=True)
    user_bias_std = _pos_float("user_bias_std", user_bias_std, allow_zero=True)
    interaction_variance = _pos_float("interaction_variance", interaction_variance, allow_zero=True)
    rho = float(popularity_bias_corr)
    if not -1.0 <= rho <= 1.0:
        raise ValueError(f"popularity_bias_corr must be in [-1, 1], got {popularity_bias_corr!r}")
    rng = np.random.default_rng(seed)
    p_item = _lognormal_probs(rng, n_items, ML10M_ITEM_LOGNORMAL)
    p_user = _lognormal_probs(rng, n_users, ML10M_USER_LOGNORMAL)
    user, item = _sample_pairs(rng, p_user, p_item, nnz, max_rounds)
    log_p = np.log(p_item)
    z = (log_p - log_p.mean()) / max(log_p.std(), 1e-12)
    item_bias = item_bias_std * (rho * z + np.sqrt(1.0 - rho * rho) * rng.standard_normal(n_items))
    user_bias = user_bias_std * rng.standard_normal(n_users)
    uf, vf = _planted_factors(rng, n_users, n_items, rank, spectrum_decay, interaction_variance)
    uf = np.column_stack([uf, user_bias, np.ones(n_users)]).astype(np.float32)
    vf = np.column_stack([vf, np.ones(n_items), item_bias]).astype(np.float32)
    rating = _planted_ratings(rng, user, item, uf, vf, mean, noise_std, lo, hi)
    data = Interactions(user, item, rating, n_users, n_items)
    return SyntheticTasks(data, uf, vf, p_item, float(mean), noise_std)


def planted_sequences(seed: int = 0, n_users: int = 2_000, n_items: int = 500, mean_length: float = 20.0,
                      follow: float = 0.7, exponent: float = 1.0, max_length: int = 200
                      ) -> tuple[list[np.ndarray], np.ndarray]:
    """Item sequences with a planted next-item rule and Zipf popularity, for sequential recommenders.

    Every item i has one planted successor succ[i], drawn from the popularity p ∝ rank^(−exponent)
    (ranks randomly permuted over ids). A user's first item is drawn from p; each next item is
    succ[previous] with probability `follow`, else a fresh draw from p. Lengths are 1 + Geometric
    (so at least 2) with mean `mean_length`, capped at `max_length`. A model that learns succ predicts a held-out next
    item with probability ≈ follow, one that predicts popularity only with probability ≈ max(p).
    Returns (one int64 array of raw item ids 1..n_items per user, succ as 1-based ids [n_items]).
    """
    _pos_int("n_users", n_users)
    _pos_int("n_items", n_items)
    _pos_int("max_length", max_length)
    if not (np.isfinite(mean_length) and mean_length > 3.0):
        raise ValueError(f"mean_length must be > 3, got {mean_length!r}")
    if not 0.0 <= follow < 1.0:
        raise ValueError(f"follow must be in [0, 1), got {follow!r}")
    if max_length < 3:
        raise ValueError(f"max_length must be >= 3 (leave-last-out needs 3 items), got {max_length!r}")
    if seed is None or isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    p = _zipf_probs(rng, n_items, _pos_float("exponent", exponent, allow_zero=True))
    succ = _sample_codes(rng, p, n_items)
    lengths = np.minimum(1 + rng.geometric(1.0 / (mean_length - 1.0), n_users), max_length)
    starts = np.cumsum(lengths) - lengths
    position = np.arange(int(lengths.sum()))
    fresh = rng.random(position.size) >= follow
    fresh[starts] = True
    last_fresh = np.maximum.accumulate(np.where(fresh, position, 0))
    depth = position - last_fresh  # planted steps since the last fresh draw
    items = _sample_codes(rng, p, position.size)[last_fresh]
    for d in range(1, int(depth.max()) + 1):  # loop over chain depth, vectorised over all positions
        at = depth >= d
        items[at] = succ[items[at]]
    return np.split(items + 1, starts[1:]), succ + 1
