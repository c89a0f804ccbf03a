"""Task collections and synthetic task generators.

A `TaskSet` holds K tasks with a fixed number n of (padded) examples each: `data` is any pytree whose
leaves have leading shape [K, n, ...] and `mask` [K, n] marks real examples (1) vs padding (0). Static
shapes let every algorithm vmap over tasks. For linear regression `data = (x [K, n, d], y [K, n])`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.noise import standard_normal, standard_uniform

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TaskSet:
    """K tasks: `data` pytree with leaves [K, n, ...], `mask` [K, n] float32 (1 = real example)."""
    data: PyTree
    mask: jax.Array

    @property
    def n_tasks(self) -> int:
        return int(self.mask.shape[0])

    @property
    def n_points(self) -> int:
        return int(self.mask.shape[1])

    def take(self, idx) -> "TaskSet":
        """Tasks at indices idx (array [m]) -> TaskSet with m tasks."""
        return TaskSet(jax.tree.map(lambda a: a[idx], self.data), self.mask[idx])

    def split_points(self, n_first: int) -> tuple["TaskSet", "TaskSet"]:
        """(first n_first points of every task, the remaining points): fine-tune / test split."""
        if not 0 < n_first < self.n_points:
            raise ValueError(f"n_first must be in (0, {self.n_points}), got {n_first}")
        a = TaskSet(jax.tree.map(lambda x: x[:, :n_first], self.data), self.mask[:, :n_first])
        b = TaskSet(jax.tree.map(lambda x: x[:, n_first:], self.data), self.mask[:, n_first:])
        return a, b


def make_taskset(data: PyTree, mask=None) -> TaskSet:
    """Validates and wraps a task pytree (leaves [K, n, ...]); mask defaults to all ones."""
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("data must contain at least one array")
    k, n = np.shape(leaves[0])[:2] if np.ndim(leaves[0]) >= 2 else (0, 0)
    if k < 1 or n < 1:
        raise ValueError(f"data leaves must have shape [K>=1, n>=1, ...], got {np.shape(leaves[0])}")
    for leaf in leaves:
        if np.shape(leaf)[:2] != (k, n):
            raise ValueError(f"every data leaf must start with [K={k}, n={n}], got {np.shape(leaf)}")
        if np.issubdtype(np.asarray(leaf).dtype, np.floating) and not np.all(np.isfinite(np.asarray(leaf))):
            raise ValueError("data contains NaN or inf")
    mask = jnp.ones((k, n), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
    if mask.shape != (k, n):
        raise ValueError(f"mask must have shape {(k, n)}, got {mask.shape}")
    if np.any(np.asarray(mask).sum(axis=1) <= 0):
        raise ValueError("mask: every task needs at least one example")
    data = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32) if np.issubdtype(np.asarray(a).dtype, np.floating)
                        else jnp.asarray(a), data)
    return TaskSet(data, mask)


# ----------------------------------------------------------------------------------------------------
# Linear regression generators (d = 30 in the paper). y = <w, x> + N(0, noise_std^2).
def _features(key, n_tasks: int, n_points: int, dim: int, features: str) -> jax.Array:
    if features == "ball":  # uniform in the unit ball
        kd, kr = jax.random.split(key)
        g = standard_normal(kd, (n_tasks, n_points, dim))
        g = g / jnp.linalg.norm(g, axis=-1, keepdims=True)
        r = standard_uniform(kr, (n_tasks, n_points, 1)) ** (1.0 / dim)
        return g * r
    if features == "authors":  # the authors' code: uniform [0,1]^d, rows normalised to unit length
        u = standard_uniform(key, (n_tasks, n_points, dim))
        return u / jnp.linalg.norm(u, axis=-1, keepdims=True)
    raise ValueError(f"features must be 'ball' or 'authors', got {features!r}")


@functools.partial(jax.jit, static_argnames=("n_points", "features"))
def _regression_tasks(key, w: jax.Array, n_points: int, noise_std, features: str) -> TaskSet:
    kx, ke = jax.random.split(key)
    n_tasks, dim = w.shape
    x = _features(kx, n_tasks, n_points, dim, features)
    y = jnp.einsum("knd,kd->kn", x, w) + noise_std * standard_normal(ke, (n_tasks, n_points))
    return TaskSet((x.astype(jnp.float32), y.astype(jnp.float32)), jnp.ones((n_tasks, n_points), jnp.float32))


@functools.partial(jax.jit, static_argnames=("n_tasks", "dim"))
def _gaussian_weights(key, n_tasks: int, dim: int, mean, std) -> jax.Array:
    return mean + std * standard_normal(key, (n_tasks, dim))


@functools.partial(jax.jit, static_argnames=("n_tasks",))
def _cluster_weights(key, n_tasks: int, centres, probs, std):
    kc, kw = jax.random.split(key)
    cid = jax.random.choice(kc, centres.shape[0], (n_tasks,), p=probs)
    return centres[cid] + std * standard_normal(kw, (n_tasks, centres.shape[1])), cid


def _check_gen(n_tasks: int, n_points: int, dim: int, noise_std: float) -> None:
    for name, v in (("n_tasks", n_tasks), ("n_points", n_points), ("dim", dim)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not np.isfinite(noise_std) or noise_std < 0:
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std}")


def single_cluster_regression(key, n_tasks: int, n_points: int = 10, dim: int = 30, mean: float = 4.0,
                              task_std: float = 1.0, noise_std: float = 0.5,
                              features: str = "ball") -> tuple[TaskSet, jax.Array]:
    """Paper's single-cluster setting: w_k ~ N(mean·1, task_std² I). Returns (tasks, w [K, d])."""
    _check_gen(n_tasks, n_points, dim, noise_std)
    if features not in ("ball", "authors"):
        raise ValueError(f"features must be 'ball' or 'authors', got {features!r}")
    kw, kd = jax.random.split(key)
    w = _gaussian_weights(kw, int(n_tasks), int(dim), jnp.float32(mean), jnp.float32(task_std))
    return _regression_tasks(kd, w, int(n_points), jnp.float32(noise_std), features), w


def cluster_centres(dim: int = 30) -> jax.Array:
    """The paper's 3 orthogonal centres: 2 on the first third, -4 on the second, 6 on the last third."""
    if dim % 3:
        raise ValueError(f"dim must be divisible by 3 for the 3-cluster centres, got {dim}")
    b = dim // 3
    c = np.zeros((3, dim), np.float32)
    c[0, :b], c[1, b:2 * b], c[2, 2 * b:] = 2.0, -4.0, 6.0
    return jnp.asarray(c)


def multi_cluster_regression(key, n_tasks: int, n_points: int = 10, dim: int = 30, task_std: float = 0.5,
                             noise_std: float = 0.5, features: str = "ball", centres=None,
                             cluster_probs=None) -> tuple[TaskSet, jax.Array, jax.Array]:
    """Paper's multi-cluster setting: centre c ~ uniform over `centres` (default `cluster_centres`),
    w_k ~ N(c, task_std² I). The authors' code draws clusters with probabilities (0.33, 0.34, 0.33).
    Returns (tasks, w [K, d], cluster id [K])."""
    _check_gen(n_tasks, n_points, dim, noise_std)
    centres = cluster_centres(dim) if centres is None else jnp.asarray(centres, jnp.float32)
    if features not in ("ball", "authors"):
        raise ValueError(f"features must be 'ball' or 'authors', got {features!r}")
    if centres.ndim != 2 or centres.shape[1] != dim:
        raise ValueError(f"centres must have shape [clusters, dim={dim}], got {centres.shape}")
    kw, kd = jax.random.split(key)
    probs = (jnp.full((centres.shape[0],), 1.0 / centres.shape[0]) if cluster_probs is None
             else jnp.asarray(cluster_probs, jnp.float32))
    w, cid = _cluster_weights(kw, int(n_tasks), centres, probs, jnp.float32(task_std))
    return _regression_tasks(kd, w, int(n_points), jnp.float32(noise_std), features), w, cid


def authors_regression(key, n_tasks: int, n_points: int = 10, dim: int = 30) -> tuple[TaskSet, jax.Array, jax.Array]:
    """The authors' generator variant: 3 clusters with probs (0.33, 0.34, 0.33), features uniform in
    [0,1]^30 normalised to unit rows, task spread 0.5, label noise 0.5."""
    return multi_cluster_regression(key, n_tasks, n_points, dim, 0.5, 0.5, "authors",
                                    cluster_probs=(0.33, 0.34, 0.33))
