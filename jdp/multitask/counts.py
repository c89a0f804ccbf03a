"""Private pre-processing statistics: per-task counts and the global mean label (centering).

Privacy unit: a user; neighbouring datasets add or remove ALL observations of one user. Each user's
contribution is bounded by first keeping at most `count_sample` of its observations (uniformly at
random), so the released statistics have the sensitivities stated below regardless of the data.
Public: n_items (the task catalogue: the length of the released count vector), count_sample, the
label bound; nothing is computed from the number of users or items present in the rows.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.accounting import PrivacyReport, Release, gaussian_event
from jdp.data.interactions import check_unique_pairs
from jdp.multitask.weights import uniform_sampling_weights
from jdp.noise import add_gaussian, gaussian_histogram
from jdp.validation import check_positive


@dataclasses.dataclass(frozen=True)
class PrivateCounts:
    counts: jax.Array          # [m] noisy counts clamped at ≥ 1 (float32)
    noise_multiplier: float    # noise std / L2 sensitivity
    sensitivity: float         # sqrt(count_sample)


def count_releases(count_sample: int, noise_multiplier: float, name: str = "task counts") -> list[Release]:
    """The release of `private_counts`: one Gaussian of L2 sensitivity √count_sample (see there)."""
    sens = math.sqrt(count_sample)
    return [Release(name, gaussian_event(noise_multiplier), sens, noise_multiplier * sens)]


def label_sum_releases(label_bound: float, count_sample: int, noise_multiplier: float,
                       name: str = "global mean") -> list[Release]:
    """The two releases of `private_label_sum`: the clipped sum (sensitivity count_sample·label_bound) and
    the number of labels (sensitivity count_sample), at one noise multiplier."""
    s_sens, c_sens = float(count_sample * label_bound), float(count_sample)
    return [Release(name + " (sum)", gaussian_event(noise_multiplier), s_sens, noise_multiplier * s_sens),
            Release(name + " (count)", gaussian_event(noise_multiplier), c_sens, noise_multiplier * c_sens)]


def private_counts(key: jax.Array, user: jax.Array, item: jax.Array, n_items: int, count_sample: int,
                   noise_multiplier: float, report: PrivacyReport | None = None,
                   name: str = "task counts") -> PrivateCounts:
    """Noisy per-task counts: each user contributes +1 to at most `count_sample` of its tasks (uniform
    subsample), Gaussian noise on EVERY task's count (zeros included), clamped ≥ 1.

    L2 sensitivity sqrt(count_sample): removing user j subtracts 1 from at most count_sample DISTINCT
    tasks, a 0/1 vector with ≤ count_sample ones. This needs one observation per (user, task): c
    copies of one pair would move one count by c (up to count_sample, i.e. √count_sample times the
    bound), so duplicate pairs raise ValueError (merge them with `Interactions.merge_duplicates`).
    noise std = noise_multiplier·sqrt(count_sample); n_items is the public task catalogue. The
    release is recorded in `report` when given.
    """
    if count_sample < 1:
        raise ValueError(f"count_sample must be >= 1, got {count_sample}")
    check_unique_pairs(user, item, ("user", "item"), "private_counts")
    item_np = np.asarray(item)
    if item_np.size and (item_np.min() < 0 or item_np.max() >= n_items):
        raise ValueError(f"item ids must lie in [0, n_items = {n_items}) (the public task catalogue)")
    check_positive(noise_multiplier, "noise_multiplier")
    k_sample, k_noise = jax.random.split(key)
    keep = uniform_sampling_weights(k_sample, user, count_sample)
    exact = jax.ops.segment_sum(keep, item, num_segments=n_items)
    (release,) = count_releases(count_sample, noise_multiplier, name)  # the noise drawn is the noise recorded
    noisy = gaussian_histogram(k_noise, exact, release.noise_scale)
    if report is not None:
        report.add_release(release)
    return PrivateCounts(jnp.maximum(noisy, 1.0), float(noise_multiplier), release.sensitivity)


def total_count_releases(count_sample: int, noise_multiplier: float, name: str = "budget-clipped total") -> list[Release]:
    """The release of `private_total_count`: one Gaussian of sensitivity count_sample (see there)."""
    sens = float(count_sample)
    return [Release(name, gaussian_event(noise_multiplier), sens, noise_multiplier * sens)]


def private_total_count(key: jax.Array, user: jax.Array, n_users: int, count_sample: int, noise_multiplier: float,
                        report: PrivacyReport | None = None, name: str = "budget-clipped total") -> float:
    """Noisy Σ_j min(n_j, count_sample): every user's number of rows, each capped at count_sample.

    Removing user j changes the total by min(n_j, count_sample) ≤ count_sample (the sensitivity; rows are
    counted, so it holds with duplicate rows too). One Gaussian release, recorded in `report`. n_users is
    the public user id space (the segment count)."""
    check_positive(noise_multiplier, "noise_multiplier")
    if count_sample < 1:
        raise ValueError(f"count_sample must be >= 1, got {count_sample}")
    user = np.asarray(user)
    if user.size and (user.min() < 0 or user.max() >= n_users):
        raise ValueError(f"user ids must lie in [0, n_users = {n_users}) (the declared user id space)")
    per_user = jnp.minimum(jnp.bincount(jnp.asarray(user), length=n_users), count_sample)
    (release,) = total_count_releases(count_sample, noise_multiplier, name)  # the noise drawn is the noise recorded
    noisy = add_gaussian(key, jnp.sum(per_user).astype(jnp.float32), release.noise_scale)
    if report is not None:
        report.add_release(release)
    return float(noisy)


def private_label_sum(key: jax.Array, user: jax.Array, label: jax.Array, label_bound: float, count_sample: int,
                      noise_multiplier: float, report: PrivacyReport | None = None,
                      name: str = "global mean") -> tuple[float, float]:
    """(noisy Σ clipped labels, noisy number of labels), the two releases behind `private_mean`.

    Each user keeps ≤ count_sample of its labels (uniform subsample) and each is clipped to
    [−label_bound, label_bound] (a public bound); NaN/inf labels raise ValueError (a NaN would survive the
    clip). Removing user j changes the sum by at most count_sample·label_bound and the count by at most
    count_sample: both sensitivities count ROWS, so they hold with or without duplicate (user, item) rows
    (a duplicate is one more row of the same user, inside its count_sample). Two Gaussian releases with the
    same noise multiplier, both recorded in `report`.
    """
    check_positive(label_bound, "label_bound")
    check_positive(noise_multiplier, "noise_multiplier")
    if count_sample < 1:
        raise ValueError(f"count_sample must be >= 1, got {count_sample}")
    # a NaN label survives the clip and turns the released sum into NaN, which tells whether its user took part
    if not np.all(np.isfinite(np.asarray(label))):
        raise ValueError("label must be finite (no NaN/inf)")
    k_sample, k_sum, k_cnt = jax.random.split(key, 3)
    keep = uniform_sampling_weights(k_sample, user, count_sample)
    clipped = jnp.clip(label, -label_bound, label_bound)
    releases = label_sum_releases(label_bound, count_sample, noise_multiplier, name)  # drawn = recorded noise
    total = add_gaussian(k_sum, jnp.sum(keep * clipped), releases[0].noise_scale)
    count = add_gaussian(k_cnt, jnp.sum(keep), releases[1].noise_scale)
    if report is not None:
        for r in releases:
            report.add_release(r)
    return float(total), float(count)


def private_mean(key: jax.Array, user: jax.Array, label: jax.Array, label_bound: float, count_sample: int,
                 noise_multiplier: float, report: PrivacyReport | None = None, name: str = "global mean") -> float:
    """Noisy global mean of labels (for centering): noisy clipped sum / noisy count.

    Each user keeps ≤ count_sample labels, each clipped to [−label_bound, label_bound] (a public bound),
    so the sum has sensitivity count_sample·label_bound and the count count_sample (see
    `private_label_sum`, which makes the two Gaussian releases and records them in `report`; the ratio
    is post-processing).
    """
    total, count = private_label_sum(key, user, label, label_bound, count_sample, noise_multiplier, report, name)
    mean = jnp.float32(total) / jnp.maximum(jnp.float32(count), 1.0)  # float32 as the statistics
    return float(jnp.clip(mean, -label_bound, label_bound))
