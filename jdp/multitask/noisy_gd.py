"""Task-weighted noisy gradient descent (Algorithm 2) for per-task linear models, squared loss.

Privacy unit: a user; neighbours add or remove all observations of one user. At each step every
(sampled) user's gradient of Σ_{i∈Ω_j} w_ij·½(⟨θ_i, x_ij⟩ − y_ij)² — a sparse [m, d] array over its
tasks — is clipped JOINTLY to L2 norm C, the clipped gradients are summed and N(0, C²σ²) is added to
every entry: one Gaussian release of sensitivity C per step. With Poisson sampling of users (rate q)
each step is a PoissonSampledDpEvent(q, Gaussian(σ)); with full batches a plain Gaussian(σ).
Shapes stay static: sampling is a per-user mask.

Per-user bound, for the user's TOTAL gradient. θ ∈ R^{m×d} has one row θ_i per task. User j's
gradient G_j has row i equal to g_ij = w_ij (⟨θ_i, x_ij⟩ − y_ij) x_ij for i ∈ Ω_j and 0 elsewhere.
If each task occurs at most once per user, the nonzero rows of G_j are distinct coordinates of θ,
so ‖G_j‖_F² = Σ_{i∈Ω_j} ‖g_ij‖² EXACTLY: there are no cross terms between a user's tasks, however
its features are aligned. The code computes this norm (per-observation squared norms summed per
user) and multiplies all of user j's rows by s_j = min(1, C / ‖G_j‖_F), so the user's total
contribution s_j G_j to the summed gradient has Frobenius norm ≤ C, with equality for any user whose
gradient exceeds C: the sensitivity of one step is C whatever the weights, features, labels or
number of tasks (the weights only share the clip among the user's tasks). A user whose gradient
overflows float32 (a non-finite squared norm) contributes 0, never a NaN. The normaliser q·n uses
the public n (`n_users`, the declared size of the user id space) and λ is data-independent, so
neither depends on the user. With c copies of one (task, user) pair the row would be the sum of c
aligned vectors, ‖Σ g‖ = c‖g‖ while the computed norm is √c‖g‖: the contribution could reach √c·C.
Duplicate pairs are therefore rejected (`jdp.data.check_unique_pairs`).
"""
from __future__ import annotations

import dataclasses
import functools

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from jdp.accounting import PrivacyReport, Release
from jdp.data.interactions import check_unique_pairs
from jdp.noise import add_gaussian, clip_by_norm
from jdp.sampling import poisson_keep
from jdp.validation import check_positive, check_privacy, renamed_keywords


@renamed_keywords(clip_norm="l2_clip")  # the old name works until the next release, with a DeprecationWarning
@dataclasses.dataclass(frozen=True)
class NoisyGDConfig:
    l2_clip: float              # C: per-user L2 gradient clip (was clip_norm)
    noise_multiplier: float     # σ: noise std / C
    steps: int
    learning_rate: float
    lam: float = 0.0            # ridge penalty λ/2·‖θ‖² (data-independent)
    sample_rate: float = 1.0    # q: Poisson sampling rate of users (1 = full batch)
    max_param_norm: float | None = None  # projection radius per task (domain C), None = no projection

    def __post_init__(self):
        check_positive(self.l2_clip, "l2_clip")
        check_positive(self.noise_multiplier, "noise_multiplier")
        check_positive(self.learning_rate, "learning_rate")
        check_positive(self.lam, "lam", allow_zero=True)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")

    def step_event(self) -> dp_accounting.DpEvent:
        g = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        return g if self.sample_rate == 1.0 else dp_accounting.PoissonSampledDpEvent(self.sample_rate, g)


def noisy_gd_releases(cfg: NoisyGDConfig, count: int = 1, prefix: str = "noisy GD") -> list[Release]:
    """The releases of `count` runs of `cfg.steps` noisy GD steps: one Gaussian (Poisson-subsampled when q < 1)
    of sensitivity C per step."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return [Release(f"{prefix} step", cfg.step_event(), float(cfg.l2_clip), cfg.noise_multiplier * cfg.l2_clip,
                    count * cfg.steps)]


def record_noisy_gd_releases(report: PrivacyReport, cfg: NoisyGDConfig, count: int = 1, prefix: str = "noisy GD") -> None:
    for r in noisy_gd_releases(cfg, count, prefix):
        report.add_release(r)


@functools.partial(jax.jit, static_argnames=("n_tasks", "n_users", "steps"))
def _run(key, theta, task, user, x, y, w, n_tasks, n_users, steps, l2_clip, sigma, lr, lam, q, radius):
    expected_batch = q * n_users
    lr, lam = lr[:, None], lam[:, None]  # per task (a scalar config broadcast to every task)

    def step(theta, k):
        k_sample, k_noise = jax.random.split(k)
        in_batch = poisson_keep(k_sample, n_users, q).astype(x.dtype)  # jdp's one Poisson sampler
        resid = jnp.einsum("nd,nd->n", theta[task], x) - y
        g_obs = (w * resid)[:, None] * x                                    # per-observation gradient rows
        # ‖G_j‖_F² = Σ_obs ‖g_obs‖², exact because (task, user) pairs are unique (see module docstring)
        user_sq = jax.ops.segment_sum(jnp.sum(g_obs**2, axis=1), user, num_segments=n_users)
        scale = in_batch * jnp.minimum(1.0, l2_clip / jnp.sqrt(jnp.maximum(user_sq, 1e-30)))
        # a user whose gradient overflows (w·resid or its square past float32, e.g. a huge weight) has a non-finite
        # squared norm and contributes 0: 0·inf would put a NaN in the released sum, revealing that it took part
        scale = jnp.where(jnp.isfinite(user_sq), scale, 0.0)[user][:, None]
        g = jax.ops.segment_sum(jnp.where(scale > 0, scale * g_obs, 0.0), task, num_segments=n_tasks)
        g = add_gaussian(k_noise, g, sigma * l2_clip)
        theta = theta - lr * (g / expected_batch + lam * theta)
        return clip_by_norm(theta, radius), None  # projection onto the ball of radius `radius`

    theta, _ = jax.lax.scan(step, theta, jax.random.split(key, steps))
    return theta


def run(key: jax.Array, init: jax.Array, task: jax.Array, user: jax.Array, x: jax.Array, y: jax.Array,
        weights: jax.Array, cfg: NoisyGDConfig, *, n_tasks: int, n_users: int, task_lr: jax.Array | None = None,
        task_ridge: jax.Array | None = None) -> jax.Array:
    """`cfg.steps` noisy GD updates from θ = `init` [n_tasks, d] on observations already prepared for the
    analysis: features ‖x‖ ≤ the bound, labels clipped, each (task, user) pair at most once. The entry point
    of `task_weighted_noisy_gd` (which checks and clips its inputs) and of callers that prepare their
    data themselves, e.g. the item update of `jdp.altmin.fit`. Records nothing: see `noisy_gd_releases`.

    `task_lr` / `task_ridge` [n_tasks] replace cfg.learning_rate / cfg.lam per task (a diagonal
    preconditioner and per-task ridge). They must be PUBLIC or computed from earlier releases only (e.g.
    released counts: post-processing); the sensitivity of a step does not depend on them, since the noise is
    added to the clipped gradient sum before they are applied."""
    radius = jnp.inf if cfg.max_param_norm is None else cfg.max_param_norm

    def per_task(value, default, name):
        value = jnp.full((n_tasks,), default, jnp.float32) if value is None else jnp.asarray(value, jnp.float32)
        if value.shape != (n_tasks,):
            raise ValueError(f"{name} must have shape ({n_tasks},), got {value.shape}")
        return value

    return _run(key, jnp.asarray(init, jnp.float32), jnp.asarray(task, jnp.int32), jnp.asarray(user, jnp.int32),
                jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(weights, jnp.float32),
                n_tasks, n_users, cfg.steps, cfg.l2_clip, cfg.noise_multiplier,
                per_task(task_lr, cfg.learning_rate, "task_lr"), per_task(task_ridge, cfg.lam, "task_ridge"),
                cfg.sample_rate, radius)


def task_weighted_noisy_gd(key: jax.Array, task: np.ndarray, user: np.ndarray, x: np.ndarray, y: np.ndarray,
                           weights: np.ndarray, n_tasks: int, n_users: int, cfg: NoisyGDConfig, *,
                           clip_x: float, clip_y: float, init: jax.Array | None = None,
                           report: PrivacyReport | None = None) -> jax.Array:
    """Algorithm 2: returns θ̂ [n_tasks, d]. Features clipped to clip_x and labels to clip_y first.

    The update is θ ← Proj(θ − η·(Σ_j clip_C(g_j) + N(0, C²σ²))/(q·n) − η·λθ), where n = n_users
    (the PUBLIC size of the user id space, declared by the caller, never a count of users present)
    and n_tasks is the public task catalogue. Each (task, user) pair must occur at most once
    (ValueError otherwise; see the module docstring for why). Releases (one per step) are recorded
    in `report`.
    """
    x = np.asarray(x, np.float32)
    nnz, d = x.shape
    if nnz == 0:
        raise ValueError("no observations")
    for name, arr in (("task", task), ("user", user), ("y", y), ("weights", weights)):
        if np.shape(arr) != (nnz,):
            raise ValueError(f"{name} must have shape ({nnz},), got {np.shape(arr)}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(np.isfinite(weights))):
        raise ValueError("x, y and weights must be finite")
    check_positive(clip_x, "clip_x")
    check_positive(clip_y, "clip_y")
    if np.min(user) < 0 or np.max(user) >= n_users:
        raise ValueError(f"user ids must lie in [0, n_users={n_users})")
    if np.min(task) < 0 or np.max(task) >= n_tasks:
        raise ValueError(f"task ids must lie in [0, n_tasks={n_tasks})")
    if report is not None:  # the one rule (jdp.validation.check_privacy): δ < 1/n of the declared user id space
        check_privacy(None, report.delta, n_users, unit=report.unit, delta_name="report.delta")
    check_unique_pairs(user, task, ("user", "task"), "task_weighted_noisy_gd")
    theta = jnp.zeros((n_tasks, d), jnp.float32) if init is None else init
    out = run(key, theta, task, user, clip_by_norm(jnp.asarray(x), clip_x),
              jnp.clip(jnp.asarray(y, jnp.float32), -clip_y, clip_y), weights, cfg, n_tasks=n_tasks, n_users=n_users)
    if report is not None:
        record_noisy_gd_releases(report, cfg)
    return out
