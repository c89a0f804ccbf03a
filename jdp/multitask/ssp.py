"""Task-weighted sufficient-statistics perturbation (Algorithm 1): a private ridge solve per task.

Privacy unit: a user; neighbours add or remove all observations of one user. With features clipped
to ‖x‖ ≤ Γx, labels to |y| ≤ Γy and weights satisfying Σ_{i∈Ω_j} w_ij² ≤ β for every user (checked),
removing a user moves the stack of A_i = Σ_j w_ij x xᵀ by ≤ √β·Γx² (Frobenius) and the stack of
b_i = Σ_j w_ij y x by ≤ √β·Γx·Γy. Proof for the user's TOTAL contribution: user j adds the block
ΔA_i = w_ij x_ij x_ijᵀ to task i for each i ∈ Ω_j, and blocks of different tasks are different
coordinates of the stack, so ‖ΔA‖_F² = Σ_{i∈Ω_j} w_ij² ‖x_ij‖⁴ ≤ Γx⁴ Σ_i w_ij² ≤ β Γx⁴ (‖x xᵀ‖_F = ‖x‖²),
and likewise ‖Δb‖² = Σ_i w_ij² y_ij² ‖x_ij‖² ≤ β Γx² Γy²; the bound is attained when every weight,
feature and label is at its maximum, whatever the directions of the x_ij. This needs each task at
most ONCE per user: c copies of (i, j) add c·w x xᵀ to ONE block, i.e. √c times the bound for the
same Σ w² (the copies are perfectly aligned), so duplicate (task, user) pairs are rejected
(`jdp.data.check_unique_pairs`). Labels may instead be bounded per USER (`clip_label_norms`): with
Σ_i w_ij² y_ij² ≤ L² the same sum gives ‖Δb‖ ≤ Γx·L, i.e. the per-label bound Γy = L/√β in every formula
here; a user whose weighted residuals are mostly small keeps a few large ones, and only users above L shrink.
Â = A + Γx²√β·σ·Ξ (Ξ symmetric, iid upper triangle) and b̂ = b + Γx·Γy·√β·σ·ξ are two Gaussian releases
with noise multiplier σ. θ̂_i = (Â_i + λ_i I)⁻¹ b̂_i is post-processing: λ_i = λ when Â_i is positive definite (then θ̂_i IS the paper's (PSD(Â_i) + λI)⁻¹ b̂_i),
otherwise a larger ridge λ + τ_i with τ_i > |λ_min(Â_i)| found by Cholesky tests on the released Â_i
(`ridge_solve`). This replaces the paper's PSD projection (clamp Â's negative eigenvalues, then solve):
an eigendecomposition per task costs ~100× a Cholesky on CPU. The regulariser λ is data-independent
(unlike the paper's Σ_j w_ij λ).

Noise for task i is drawn from `fold_in(key, i)`, so results do not depend on how tasks are sharded.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp.accounting import PrivacyReport, Release, gaussian_event
from jdp.data.interactions import check_unique_pairs
from jdp.multitask import gram
from jdp.noise import clip_by_norm, keyed_gram_noise
from jdp.validation import check_positive, check_privacy


@dataclasses.dataclass(frozen=True)
class SSPNoise:
    """Absolute noise stds on A and b (0 for the non-private reference) and the ridge λ."""
    std_a: float
    std_b: float
    lam: float


def ssp_noise(noise_multiplier: float, beta: float, clip_x: float, clip_y: float, lam: float) -> SSPNoise:
    check_positive(noise_multiplier, "noise_multiplier")
    check_positive(beta, "beta")
    a, b = ssp_releases(noise_multiplier, beta, clip_x, clip_y)  # the noise drawn is the noise recorded
    return SSPNoise(a.noise_scale, b.noise_scale, check_positive(lam, "lam"))


def ssp_releases(noise_multiplier: float, beta: float, clip_x: float, clip_y: float, count: int = 1,
                 prefix: str = "SSP", gram_count: int | None = None, gram_noise_ratio: float = 1.0) -> list[Release]:
    """The two Gaussian releases (A and b) of `count` SSP solves, with the sensitivities of the module docstring.

    `gram_count` (default `count`): how many distinct A are released; fewer when the features are public
    constants, so that every solve's A is the same statistic and its one noisy release is reused (`solve_tasks`'
    `gram_key`). `gram_noise_ratio`: A's noise multiplier over b's (A at r·σ, b at σ)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    gram_count = count if gram_count is None else gram_count
    if not 1 <= gram_count <= count:
        raise ValueError(f"gram_count must be in [1, count={count}], got {gram_count}")
    check_positive(gram_noise_ratio, "gram_noise_ratio")
    sigma_a = gram_noise_ratio * noise_multiplier
    sens_a, sens_b = float(math.sqrt(beta) * clip_x**2), float(math.sqrt(beta) * clip_x * clip_y)
    return [Release(f"{prefix} A (Gram)", gaussian_event(sigma_a), sens_a, sigma_a * sens_a, gram_count),
            Release(f"{prefix} b (rhs)", gaussian_event(noise_multiplier), sens_b, noise_multiplier * sens_b, count)]


def record_ssp_releases(report: PrivacyReport, noise_multiplier: float, beta: float, clip_x: float,
                        clip_y: float, count: int = 1, prefix: str = "SSP") -> None:
    """Adds the two Gaussian releases (A and b) of `count` SSP solves to the report."""
    for r in ssp_releases(noise_multiplier, beta, clip_x, clip_y, count, prefix):
        report.add_release(r)


INVERSE_COUNT_GRID = 512  # log-spaced count values of the posterior in `inverse_count`


def inverse_count(n_hat: jax.Array, noise_std, n_max) -> jax.Array:
    """E[1/n | n̂]: the posterior mean of 1/n for a count observed as n̂ = n + N(0, noise_std²), under the public,
    scale-free prior p(n) ∝ 1/n on [1, n_max] (post-processing of a released count). Where the noise is small
    against the count (noise_std ≤ 5% of n̂, or 0: an exact count) it is 1/max(n̂, 1). Where the noise is large the
    prior's mass at small counts dominates, so a count that came out high by noise does not pass for a large one:
    a ridge ∝ E[1/n] keeps shrinking what such a task releases (a plug-in 1/n̂ would not)."""
    return count_posterior_mean(n_hat, noise_std, n_max, lambda n: 1.0 / n)


def count_posterior_mean(n_hat: jax.Array, noise_std, n_max, f) -> jax.Array:
    """E[f(n) | n̂] for counts observed as n̂ = n + N(0, noise_std²) under the public, scale-free prior p(n) ∝ 1/n on
    [1, n_max] (`inverse_count`'s posterior; f elementwise, e.g. n ↦ 1/n or n ↦ n^(−μ)); f(max(n̂, 1)) where
    noise_std ≤ 5% of n̂ (or 0: exact counts)."""
    n_hat = jnp.asarray(n_hat, jnp.float32)
    plug_in = f(jnp.maximum(n_hat, 1.0))

    def posterior():
        grid = jnp.exp(jnp.linspace(0.0, jnp.log(jnp.maximum(n_max, 2.0)), INVERSE_COUNT_GRID))  # equal prior mass
        z = jnp.clip((n_hat[:, None] - grid[None, :]) / jnp.maximum(noise_std, 1e-30), -1e18, 1e18)  # z² finite
        post = jax.nn.softmax(-0.5 * z**2, axis=1) @ f(grid)
        return jnp.where(noise_std <= 0.05 * n_hat, plug_in, post)

    # exact counts (every non-private solve, and every user solve) skip the [tasks, grid] posterior entirely
    return jax.lax.cond(jnp.asarray(noise_std) > 0, posterior, lambda: plug_in)


def _task_ridge(a, lam, count_ridge):
    """Per-task ridge max(lam, offset + inverse·E[1/n_i] + per_count·n_i), n_i = A_i[-1, -1] / unit: the task's
    weighted count read off its (released, when noisy) Gram through a constant last feature √unit, with E[1/n_i]
    from `inverse_count` (noise std count_noise, prior up to count_max; 1/max(n_i, 1) for an exact count)."""
    offset, inverse, per_count, unit, count_noise, count_max = (count_ridge[i] for i in range(6))
    n = a[:, -1, -1] / unit
    return jnp.maximum(jnp.asarray(lam, a.dtype),
                       offset + inverse * inverse_count(n, count_noise, count_max) + per_count * jnp.maximum(n, 0.0))


def _cholesky_jnp(m):
    """Batched Cholesky [t, n, n] -> lower L from plain jnp ops (one loop step per column); NaN where m
    is not positive definite, like LAPACK's."""
    n = m.shape[-1]
    below = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]

    def column(j, l):
        c = m[:, :, j] - jnp.einsum("tik,tk->ti", l, l[:, j, :])  # columns ≥ j of l are still 0
        c = jnp.where(below[:, j], c, 0.0) / jnp.sqrt(c[:, j])[:, None]
        return l.at[:, :, j].set(c)
    return jax.lax.fori_loop(0, n, column, jnp.zeros_like(m))


def _cho_solve_jnp(l, b):
    """Solves L Lᵀ x = b for batched lower L [t, n, n], b [t, n] by substitution."""
    n = b.shape[-1]

    def fwd(j, y):
        return y.at[:, j].set((b[:, j] - jnp.einsum("tk,tk->t", l[:, j, :], y)) / l[:, j, j])

    def bwd(i, x):
        j = n - 1 - i
        return x.at[:, j].set((y[:, j] - jnp.einsum("tk,tk->t", l[:, :, j], x)) / l[:, j, j])
    y = jax.lax.fori_loop(0, n, fwd, jnp.zeros_like(b))
    return jax.lax.fori_loop(0, n, bwd, jnp.zeros_like(b))


def ridge_solve(a, b, lam, adaptive: bool = False, lapack: bool = True):
    """x = (a + (λ + τ)I)⁻¹ b for a batch a [t, d, d], b [t, d], by Cholesky; τ = 0 unless `adaptive`.

    `adaptive` (noisy Grams, which may be indefinite): τ_t is the first of 0, λ/4, λ/2, λ, 2λ, … (capped
    just above ‖a_t‖_F ≥ |λ_min(a_t)|) with a_t + τ_t I positive definite. So a PD a_t gets exactly the
    PSD-projected solve (PSD(a) + λI)⁻¹ b, and an indefinite one the ridge λ + τ_t with |λ_min| < τ_t ≤
    max(2|λ_min|, λ/4) (the projection would use λ in the clamped directions, e + λ in the others): every
    solve's matrix has eigenvalues ≥ λ, as with the projection.
    `lapack=False` uses plain jnp ops instead of the LAPACK kernels: on CPU those batch their work on
    XLA's intra-op thread pool and then wait for it, which deadlocks when several devices of one
    process (a CPU mesh) occupy every pool thread at once. Both give the same x to float32 accuracy.
    """
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    # both factorisations read the lower triangle only; a is symmetric (a Gram plus mirrored noise), so
    # LAPACK's default (a + aᵀ)/2 pass over the whole batch is skipped
    cholesky = functools.partial(jnp.linalg.cholesky, symmetrize_input=False) if lapack else _cholesky_jnp
    tau = jnp.zeros(a.shape[:1], a.dtype)
    if adaptive:
        def is_pd(tau):
            return jnp.all(jnp.isfinite(cholesky(a + tau[:, None, None] * eye)), axis=(1, 2))

        cap = jnp.sqrt(jnp.sum(a * a, axis=(1, 2))) * (1 + 1e-3) + 1e-3 * lam

        def retry(state):
            tau, ok, k = state
            tau = jnp.where(ok, tau, jnp.minimum(jnp.maximum(2 * tau, lam / 4), cap))
            return tau, ok | is_pd(tau), k + 1

        tau, *_ = jax.lax.while_loop(lambda s: ~jnp.all(s[1]) & (s[2] < 64), retry, (tau, is_pd(tau), 0))
    l = cholesky(a + (lam + tau)[:, None, None] * eye)
    if lapack:
        return jax.vmap(lambda c, r: jax.scipy.linalg.cho_solve((c, True), r))(l, b)
    return _cho_solve_jnp(l, b)


def _solve_shard(feats, classes, class_tasks, stack_index, key, gram_key, std_a, std_b, lam, count_ridge, prior_last,
                 noisy, lapack, stats):
    """Gram (+ noise) + ridge solve for one shard's tasks -> θ [block, d] (+ 2 columns Â_i[-1, -1], b̂_i[-1] if stats).
    The class Grams are stacked as they come (class by class) and solved in that order by ONE batched solve
    (independent LAPACK calls in one program can deadlock XLA's CPU thread pool); only the solutions are put
    back in slot order. The noise of a task is keyed by its global id."""
    grams = [gram.class_gram(feats, *cl) for cl in classes]
    a, b = jnp.concatenate([g[0] for g in grams]), jnp.concatenate([g[1] for g in grams])
    tasks = jnp.concatenate(class_tasks)
    if noisy:
        na, nb = keyed_gram_noise(key, tasks, feats.shape[1], std_a, std_b, gram_key=gram_key)
        a, b = a + na, b + nb
    if prior_last is None:
        theta = ridge_solve(a, b, _task_ridge(a, lam, count_ridge), adaptive=noisy, lapack=lapack)
    else:  # the ridge centred on t·e: solve for θ − t·e
        t = prior_last[tasks]
        theta = ridge_solve(a, b - t[:, None] * a[:, :, -1], _task_ridge(a, lam, count_ridge), adaptive=noisy,
                            lapack=lapack)
        theta = theta.at[:, -1].add(t)
    out = jnp.concatenate([theta, a[:, -1, -1, None], b[:, -1, None]], axis=1) if stats else theta
    return jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])[stack_index]


def _solve_blocks(feats, classes, class_tasks, stack_index, key, gram_key, std_a, std_b, lam, count_ridge, prior_last,
                  noisy, lapack, stats):
    """Shards one after another (lax.map over the leading axis) -> θ [S·block, d (+ 2)]."""
    def one(args):
        cls, ct, si = args
        return _solve_shard(feats, cls, ct, si, key, gram_key, std_a, std_b, lam, count_ridge, prior_last, noisy,
                            lapack, stats)
    out = jax.lax.map(one, (classes, class_tasks, stack_index))
    return out.reshape(-1, out.shape[-1])


def solve_tasks(feats: jax.Array, classes, class_tasks, stack_index: jax.Array, key: jax.Array,
                std_a: float, std_b: float, lam: float, mesh: Mesh | None = None, noisy: bool = True,
                count_ridge: jax.Array | None = None, bias_stats: bool = False,
                gram_key: jax.Array | None = None, prior_last: jax.Array | None = None) -> jax.Array:
    """θ for every task slot [P·block, d] (index with `plan.flat_index`).

    feats [rows, d] is replicated; classes (`gram.device_arrays`), class_tasks (`gram.class_tasks`) and
    stack_index carry a leading shard axis P. With a
    mesh (axis 'tasks' of D devices, P divisible by D) each device solves its P/D shards; without one
    the shards run in turn on one device (which also bounds memory for very many tasks). Sharded
    results come back to the device(s) of `feats`, so a training loop keeps one input layout (and one
    compilation) from step to step.
    `count_ridge` (the last feature must be a constant γ₀): [offset, inverse, per_count, γ₀², count_noise, count_max]
    gives task i the ridge max(lam, offset + inverse·E[1/n_i] + per_count·n_i) with n_i = Â_i[-1, -1] / γ₀² the task's
    weighted count as the (noisy, when private) Gram holds it and E[1/n_i] its posterior mean given the count's noise
    std (`inverse_count`; 0: exact, 1/max(n_i, 1)): e.g. a posterior ridge for a private release
    (computed from released values only), or a ridge proportional to the count for the non-private reference.
    `bias_stats`: two more columns per task, Â_i[-1, -1] and b̂_i[-1] (the released noisy count and label sum
    of the constant feature), for post-processing such as an empirical-Bayes prior.
    `gram_key`: A's noise is keyed by it (b's by `key`; `jdp.noise.keyed_gram_noise`). Passing the same gram_key
    to solves whose A is the same statistic (public constant features, fixed weights) releases that A ONCE
    (`ssp_releases(gram_count=1)`); the caller must make sure A is unchanged, e.g. by comparing the released
    Â columns (`bias_stats`) across solves.
    `prior_last`: [n_tasks] prior means t_i of the LAST coordinate (the constant feature's: an item bias / γ₀):
    task i's ridge then pulls θ toward t_i·e instead of 0, θ_i = t_i·e + (Â_i + ρ_i I)⁻¹(b̂_i − t_i·Â_i e), computed
    from the same released Â_i, b̂_i (post-processing). None: 0.
    """
    if count_ridge is None:  # every task keeps lam
        count_ridge = jnp.asarray([0.0, 0.0, 0.0, 1.0, 0.0, 1.0], jnp.float32)
    if prior_last is not None:  # a 0 for the padding rows' task id n_tasks
        prior_last = jnp.concatenate([jnp.ravel(jnp.asarray(prior_last, jnp.float32)), jnp.zeros(1, jnp.float32)])
    args = (feats, classes, class_tasks, stack_index, key, gram_key, std_a, std_b, lam, count_ridge, prior_last)
    if mesh is None or isinstance(feats, jax.core.Tracer):
        return _solve_tasks(*args, mesh=mesh, noisy=noisy, stats=bias_stats)
    home = feats.sharding if isinstance(feats, jax.Array) else jax.devices()[0]
    feats = jax.device_put(feats, NamedSharding(mesh, PartitionSpec()))
    out = _solve_tasks(feats, *args[1:], mesh=mesh, noisy=noisy, stats=bias_stats)
    return jax.device_put(out, home)


@functools.partial(jax.jit, static_argnames=("mesh", "noisy", "stats"))
def _solve_tasks(feats, classes, class_tasks, stack_index, key, gram_key, std_a, std_b, lam, count_ridge, prior_last,
                 mesh, noisy, stats):
    args = (classes, class_tasks, stack_index)
    if mesh is None:
        return _solve_blocks(feats, *args, key, gram_key, std_a, std_b, lam, count_ridge, prior_last, noisy, True, stats)
    spec = PartitionSpec("tasks")
    lapack = mesh.devices.flat[0].platform != "cpu"  # see ridge_solve: LAPACK deadlocks on a CPU mesh

    def body(feats, classes, class_tasks, stack_index, key, gram_key, std_a, std_b, lam, count_ridge, prior_last):
        return _solve_blocks(feats, classes, class_tasks, stack_index, key, gram_key, std_a, std_b, lam, count_ridge,
                             prior_last, noisy, lapack, stats)

    rep = PartitionSpec()
    class_specs = tuple((spec, spec, spec) for _ in classes)
    task_specs = tuple(spec for _ in class_tasks)
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(rep, class_specs, task_specs, spec, rep, rep, rep, rep, rep, rep, rep),
                         out_specs=spec, check_vma=False)(feats, *args, key, gram_key, std_a, std_b, lam, count_ridge,
                                                          prior_last)


def task_mesh(n_shards: int | None = None) -> Mesh | None:
    """A 1-d mesh named 'tasks' over the first n_shards of `jax.devices()` (None: all; no mesh for one device)."""
    devices = jax.devices()
    n = len(devices) if n_shards is None else n_shards
    if n < 1 or n > len(devices):
        raise ValueError(f"n_shards must be in [1, {len(devices)}], got {n_shards}")
    return None if n == 1 else Mesh(np.asarray(devices[:n]), ("tasks",))


def clip_label_norms(user: jax.Array, weights: jax.Array, labels: jax.Array, n_users: int, bound: float) -> jax.Array:
    """Labels scaled per user so that √(Σ_i w_ij² y_ij²) ≤ `bound` (a per-user transformation of the user's own
    rows): b's sensitivity is then Γx·bound (module docstring), whatever the per-label bound."""
    check_positive(bound, "bound")
    return _clip_label_norms(user, weights, labels, int(n_users), bound)


@functools.partial(jax.jit, static_argnames="n_users")  # eagerly, each operation would compile on its own
def _clip_label_norms(user, weights, labels, n_users, bound):
    norm2 = jax.ops.segment_sum((weights * labels) ** 2, user, num_segments=n_users)
    scale = jnp.minimum(1.0, bound / jnp.sqrt(jnp.maximum(norm2, 1e-30)))
    return labels * scale[user]


def check_user_budget(user: np.ndarray, weights: np.ndarray, n_users: int, beta: float) -> None:
    """Raises ValueError unless every user's Σ_i w_ij² ≤ β (the accountant's assumption)."""
    w = np.asarray(weights, np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and >= 0")
    per_user = np.bincount(np.asarray(user), weights=w**2, minlength=n_users)
    if per_user.max(initial=0.0) > beta * (1 + 1e-5):
        raise ValueError(f"weights exceed the per-user budget: max_j sum_i w_ij^2 = {per_user.max():.4g} > beta = {beta}")


def task_weighted_ssp(key: jax.Array, task: np.ndarray, user: np.ndarray, x: np.ndarray, y: np.ndarray,
                      weights: np.ndarray, n_tasks: int, n_users: int, *, beta: float, clip_x: float,
                      clip_y: float, noise_multiplier: float, lam: float, report: PrivacyReport | None = None,
                      n_shards: int | None = None) -> jax.Array:
    """Algorithm 1 over observations (task i, user j, features x_ij [nnz, d], label y_ij, weight w_ij).

    Returns θ̂ [n_tasks, d]. Features are clipped to ‖x‖ ≤ clip_x and labels to |y| ≤ clip_y before
    accumulation; weights must satisfy the per-user budget β (see `jdp.multitask.weights`). The two
    Gaussian releases are recorded in `report`. Tasks are sharded over `n_shards` local devices (None:
    all of them); the result does not depend on the number.
    """
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    nnz = x.shape[0]
    if nnz == 0:
        raise ValueError("no observations")
    for name, arr in (("task", task), ("user", user), ("y", y), ("weights", weights)):
        if np.shape(arr) != (nnz,):
            raise ValueError(f"{name} must have shape ({nnz},), got {np.shape(arr)}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite")
    if np.min(user) < 0 or np.max(user) >= n_users:
        raise ValueError(f"user ids must lie in [0, {n_users})")
    check_positive(clip_x, "clip_x")
    check_positive(clip_y, "clip_y")
    if report is not None:  # the one rule (jdp.validation.check_privacy): δ < 1/n of the declared user id space
        check_privacy(None, report.delta, n_users, unit=report.unit, delta_name="report.delta")
    check_unique_pairs(user, task, ("user", "task"), "task_weighted_ssp")
    check_user_budget(user, weights, n_users, beta)
    noise = ssp_noise(noise_multiplier, beta, clip_x, clip_y, lam)
    mesh = task_mesh(n_shards)
    plan = gram.build_plan(task, np.arange(nnz), weights, n_tasks, n_shards=1 if mesh is None else mesh.size)
    classes, stack_index = gram.device_arrays(plan, plan.slot_values(np.clip(y, -clip_y, clip_y)))
    feats = clip_by_norm(jnp.asarray(x), clip_x)
    theta = solve_tasks(feats, classes, gram.class_tasks(plan), stack_index, key,
                        noise.std_a, noise.std_b, noise.lam, mesh=mesh)
    if report is not None:
        record_ssp_releases(report, noise_multiplier, beta, clip_x, clip_y)
    return theta[jnp.asarray(plan.flat_index)]
