"""Budget allocation across tasks: adaptive weights (eqs. 12, 16) and sampling baselines as weights.

Every user j has an RDP budget β: the accountant needs Σ_{i∈Ω_j} w_ij² ≤ β for every user. All
functions here guarantee it exactly, for any input, and depend only on (released) private counts,
PUBLIC sizes (n in eq. 16 is the declared size of the user population, never the number of users
present in the rows) and on the user's own task set, so computing them costs no privacy. The
weights themselves are never released.

Ω_j is a SET of tasks: the consumers' sensitivities (SSP, noisy GD) assume one observation per
(user, task). The functions that take task ids reject duplicate pairs (`jdp.data.check_unique_pairs`)
when called on concrete arrays; under jit the check cannot run, and the private consumers
(`task_weighted_ssp`, `task_weighted_noisy_gd`, `jdp.altmin.fit`) enforce it themselves.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jdp.data.interactions import check_unique_pairs
from jdp.validation import check_positive

# Per-user sums are float32 (relative error up to ~n·2⁻²⁴ for a user with n tasks): weights are scaled to
# (1 − 1e-3)·β so that the EXACT Σ_i w_ij² stays ≤ β, which is what the accountant assumes.
_BUDGET_SAFETY = 1.0 - 1e-3


def _check_task_sets(user, item, where: str) -> None:
    # Host-side check; skipped for tracers (under jit), where the private consumer checks instead.
    if not any(isinstance(a, jax.core.Tracer) for a in (user, item)):
        check_unique_pairs(user, item, ("user", "item"), where)


def task_weights(counts: jax.Array, mu: float, n_users: int, beta: float) -> jax.Array:
    """ω_i = n̂_i^(−μ) / sqrt(Σ_i' n̂_i'^(1−2μ) / (n·β)), i.e. Σ_i n̂_i ω_i² = n·β (eq. 16).

    counts: private task counts n̂ [m] (clamped ≥ 1 here); mu ≥ 0 shifts budget towards the tail;
    n_users: size of the user population, PUBLIC (declared by the caller, e.g. the user id space
    `Interactions.n_users`; never the number of users present, which would make every user's weight
    depend on whether one more user is in the data); beta: per-user RDP budget.
    """
    check_positive(mu, "mu", allow_zero=True)
    check_positive(beta, "beta")
    if n_users < 1:
        raise ValueError(f"n_users must be >= 1, got {n_users}")
    return _task_weights(jnp.asarray(counts, jnp.float32), mu, n_users, beta)


# The kernels below are jitted (values traced, sizes static): run eagerly, each jnp operation compiles a
# kernel of its own per new shape, a second of a small fit's first run.
@jax.jit
def _task_weights(counts, mu, n_users, beta):
    c = jnp.maximum(counts, 1.0)
    raw = c ** (-mu)
    return raw * jnp.sqrt(n_users * beta / jnp.sum(c * raw**2))


@functools.partial(jax.jit, static_argnames=("n_users", "normalize"))
def _scale_per_user(omega, user, item, n_users, beta, normalize):
    w = omega[item]
    per_user = jax.ops.segment_sum(w**2, user, num_segments=n_users)
    factor = jnp.sqrt(_BUDGET_SAFETY * beta / jnp.maximum(per_user, 1e-30))
    return w * (factor if normalize else jnp.minimum(1.0, factor))[user]


def clip_user_weights(omega: jax.Array, user: jax.Array, item: jax.Array, n_users: int, beta: float) -> jax.Array:
    """Paper's per-user clipping (eq. 12): w_ij = ω_i·min(1, sqrt(β / Σ_{i'∈Ω_j} ω_i'²)). Returns [nnz].

    Duplicate (user, item) pairs raise ValueError (Ω_j is a set; see the module docstring)."""
    _check_task_sets(user, item, "clip_user_weights")
    return _scale_per_user(omega, user, item, int(n_users), beta, normalize=False)


def normalize_user_weights(omega: jax.Array, user: jax.Array, item: jax.Array, n_users: int, beta: float) -> jax.Array:
    """Reference-code normalisation: w_ij = sqrt(β·ω_i² / Σ_{i'∈Ω_j} ω_i'²), so Σ_i w_ij² = β (up to the
    float32 safety margin).

    Unlike clipping, this up-weights users with few tasks (a user with one task gets weight √β).
    Duplicate (user, item) pairs raise ValueError.
    """
    _check_task_sets(user, item, "normalize_user_weights")
    return _scale_per_user(omega, user, item, int(n_users), beta, normalize=True)


def adaptive_weights(counts: jax.Array | None, user: jax.Array, item: jax.Array, n_users: int, beta: float,
                     mu: float, mode: str = "clip", n_tasks: int | None = None) -> jax.Array:
    """Per-observation adaptive weights from private counts: eq. 16 then `clip` (default) or `normalize`.

    n_users is the PUBLIC size of the user population (see `task_weights`); duplicate (user, item)
    pairs raise ValueError. `counts=None` (no counts released; give `n_tasks`, the public number of tasks):
    ω_i = 1 for every task, the μ = 0 allocation without the total count, i.e. under `clip` a user with at
    most β tasks keeps weight 1 on each and a heavier user's weights are scaled to Σ_i w_ij² = β."""
    if counts is None:
        if n_tasks is None:
            raise ValueError("adaptive_weights without counts needs n_tasks (the public number of tasks)")
        omega = jnp.ones(int(n_tasks), jnp.float32)
    else:
        omega = task_weights(counts, mu, n_users, beta)
    if mode == "clip":
        return clip_user_weights(omega, user, item, n_users, beta)
    if mode == "normalize":
        return normalize_user_weights(omega, user, item, n_users, beta)
    raise ValueError(f"mode must be 'clip' or 'normalize', got {mode!r}")


@jax.jit
def _rank_within_user(user: jax.Array, *priorities: jax.Array) -> jax.Array:
    """0-based rank of each observation among its user's observations, ordered by `priorities`
    ascending (first one primary, later ones break ties)."""
    order = jnp.lexsort((*reversed(priorities), user))
    sorted_user = user[order]
    pos = jnp.arange(user.shape[0])
    first = jnp.searchsorted(sorted_user, sorted_user, side="left")
    rank_sorted = pos - first
    return jnp.zeros_like(pos).at[order].set(rank_sorted)


def uniform_sampling_weights(key: jax.Array, user: jax.Array, k: int, scale: float = 1.0) -> jax.Array:
    """Each user keeps k of its tasks uniformly at random: weight `scale` on kept, 0 elsewhere.

    Σ_i w_ij² ≤ k·scale² for every user (over rows; takes no task ids, so the consumer checks that
    each task occurs once per user).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return _keep_lowest(user, k, scale, jax.random.uniform(key, jnp.shape(user)))


@jax.jit
def _keep_lowest(user, k, scale, *priorities):
    """`scale` on each user's k rows lowest in `priorities` (lexicographic), 0 elsewhere."""
    return jnp.where(_rank_within_user(user, *priorities) < k, scale, 0.0).astype(jnp.float32)


def tail_sampling_weights(key: jax.Array, user: jax.Array, item: jax.Array, counts: jax.Array, k: int,
                          scale: float = 1.0) -> jax.Array:
    """Tail-biased sampling (Chien et al. 2021): each user keeps its k tasks with the SMALLEST private
    counts (ties broken at random). Weight `scale` on kept tasks, 0 elsewhere. Duplicate (user, item)
    pairs raise ValueError (they would let a user keep k copies of one task)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    _check_task_sets(user, item, "tail_sampling_weights")
    return _keep_least_counted(user, item, jnp.asarray(counts, jnp.float32), k, scale,
                               jax.random.uniform(key, jnp.shape(user)))


@jax.jit
def _keep_least_counted(user, item, counts, k, scale, tiebreak):
    return _keep_lowest(user, k, scale, counts[item], tiebreak)
