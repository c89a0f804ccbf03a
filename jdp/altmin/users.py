"""The user side of alternating minimization: every user's exact ridge solve of (u_j, b_j[, a_j]) from the
released item side and the user's own ratings (billboard model: no privacy cost, nothing released)."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdp.altmin.config import AltMinConfig
from jdp.data import Interactions
from jdp.multitask import gram
from jdp.multitask.ssp import solve_tasks

USERS_PER_BLOCK = 16384  # user solves run in blocks of this many users to bound memory (A is d×d per user)


class UserEmbeddings(NamedTuple):
    """Each user's solved embedding u_j [n_users, d], bias b_j [n_users] (0 without biases) and the scale a_j
    [n_users] the user puts on the released item biases (None: 1 for everyone)."""
    factors: np.ndarray
    bias: np.ndarray
    slope: np.ndarray | None = None


# Small jitted kernels for the host loop: run eagerly, every jnp operation compiles a kernel of its own per new
# shape (most of a small fit's first run).
@jax.jit
def residuals(rating, index, bias, mean, clip):
    """clip(r − μ − bias[index], ±clip) in float32 (clip = inf: unclipped)."""
    resid = rating - mean - jnp.asarray(bias, jnp.float32)[index]
    return jnp.clip(resid, -clip, clip)


@jax.jit
def take_rows(x, index):
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
        resid = residuals(self.rating, self.item, item_bias, mean, math.inf)
        if v.shape[1] <= SMALL_SOLVE_FEATURES and self.count_ridge is None:
            coef = np.asarray(_small_user_solves(v, self.item, jnp.asarray(self.data.user), resid, self.user_reg,
                                                 self.data.n_users))
        else:
            classes, class_tasks, stack_index, obs_index, flat_index = self.class_layout()
            classes = gram.with_labels(classes, obs_index, resid)
            coef = np.asarray(take_rows(solve_tasks(v, classes, class_tasks, stack_index, jax.random.key(0), 0.0, 0.0,
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
