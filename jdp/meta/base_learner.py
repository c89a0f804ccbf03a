"""Base learners: w_h(Z) = argmin_w R_Z(w) + (λ/2)‖w − h‖² for one task, vmappable over tasks.

`R_Z(w)` is the masked mean of a user-supplied per-example loss `loss_fn(params, example) -> scalar`
over the task's examples (a pytree with leading axis n); params and h are any pytree. Two solvers:

- `SGDLearner`: a fixed number of (S)GD steps started at h (full batch, or minibatches drawn without
  replacement from the task's real examples each step), as in the paper's approximate base learner.
- `RidgeLearner`: the exact closed form for the squared loss of a linear model,
  (2/n XᵀX + λI) w = 2/n Xᵀy + λh.

The meta-gradient of the Moreau envelope L_Z(h) = min_w R_Z,λ(w; h) is ∇L_Z(h) = λ(h − w_h(Z)).
Everything here is per task; the meta algorithms vmap it over tasks and meta-models.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jdp.validation import check_positive

PyTree = Any


def squared_loss(w: jax.Array, example) -> jax.Array:
    """(⟨w, x⟩ − y)² for one example (x [d], y []): the MSE the paper's experiments use."""
    x, y = example
    return (jnp.dot(x, w) - y) ** 2


def sq_dist(a: PyTree, b: PyTree) -> jax.Array:
    return sum(jnp.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def masked_mean_loss(loss_fn: Callable, params: PyTree, data: PyTree, mask: jax.Array) -> jax.Array:
    """Σ mask·ℓ(params, z) / Σ mask over the task's examples."""
    per = jax.vmap(loss_fn, in_axes=(None, 0))(params, data)
    return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@dataclasses.dataclass(frozen=True)
class SGDLearner:
    """Fixed-step (S)GD on R_Z(w) + (λ/2)‖w − h‖² from w = h.

    loss_fn(params, example) -> scalar; batch_size None = full-batch GD, else minibatches of that size
    drawn without replacement each step (the authors' code: 20 steps, lr 0.07, batch 4 of 10 points).
    """
    loss_fn: Callable[[PyTree, PyTree], jax.Array]
    lam: float
    steps: int = 20
    lr: float = 0.07
    batch_size: int | None = None
    unroll: int = 1  # lax.scan unroll of the inner steps (larger: fewer kernel launches, longer compile)
    minibatch: str = "resample"  # "resample": fresh random batch each step; "cycle": one shuffle, cyclic windows

    def __post_init__(self):
        check_positive(self.lam, "lam")
        check_positive(self.lr, "lr")
        if int(self.steps) < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size is not None and int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {self.batch_size}")
        if self.minibatch not in ("resample", "cycle"):
            raise ValueError(f"minibatch must be 'resample' or 'cycle', got {self.minibatch!r}")

    def risk(self, w: PyTree, data: PyTree, mask: jax.Array) -> jax.Array:
        return masked_mean_loss(self.loss_fn, w, data, mask)

    def objective(self, w: PyTree, h: PyTree, data: PyTree, mask: jax.Array) -> jax.Array:
        """R_Z(w) + (λ/2)‖w − h‖²."""
        return self.risk(w, data, mask) + 0.5 * self.lam * sq_dist(w, h)

    def fit(self, h: PyTree, data: PyTree, mask: jax.Array, key: jax.Array) -> PyTree:
        """Approximate w_h(Z) for one task (data leaves [n, ...], mask [n])."""
        n = mask.shape[0]
        b = None if self.batch_size is None else min(int(self.batch_size), n)

        if b is not None and self.minibatch == "cycle":
            # one random order of the real examples (padding last), then consecutive cyclic windows of b;
            # 1 random draw per fit instead of one per step (cheaper on CPU, same per-step distribution
            # over the real examples when n_real is a multiple of b)
            g = jax.random.gumbel(key, (n,)) + jnp.where(mask > 0, 0.0, -jnp.inf)
            perm = jnp.argsort(-g)
            n_real = jnp.maximum(jnp.sum(mask > 0), 1)

            def step_c(w, s):
                idx = perm[(s * b + jnp.arange(b)) % n_real]
                d, m = jax.tree.map(lambda a: a[idx], data), mask[idx]
                grad = jax.grad(self.objective)(w, h, d, m)
                return jax.tree.map(lambda p, gr: p - self.lr * gr, w, grad), None

            w, _ = jax.lax.scan(step_c, h, jnp.arange(int(self.steps)), unroll=int(self.unroll))
            return w

        def step(w, k):
            if b is None:
                d, m = data, mask
            else:  # b real examples without replacement: top-b of Gumbel noise over the real ones
                g = jax.random.gumbel(k, (n,)) + jnp.where(mask > 0, 0.0, -jnp.inf)
                idx = jax.lax.top_k(g, b)[1]
                d, m = jax.tree.map(lambda a: a[idx], data), mask[idx]
            grad = jax.grad(self.objective)(w, h, d, m)
            return jax.tree.map(lambda p, gr: p - self.lr * gr, w, grad), None

        w, _ = jax.lax.scan(step, h, jax.random.split(key, int(self.steps)), unroll=int(self.unroll))
        return w


@dataclasses.dataclass(frozen=True)
class RidgeLearner:
    """Exact base learner for mean (⟨w, x⟩ − y)² + (λ/2)‖w − h‖²; params w [d], data (x [n, d], y [n])."""
    lam: float

    def __post_init__(self):
        check_positive(self.lam, "lam")

    loss_fn = staticmethod(squared_loss)

    def risk(self, w, data, mask):
        return masked_mean_loss(squared_loss, w, data, mask)

    def objective(self, w, h, data, mask):
        return self.risk(w, data, mask) + 0.5 * self.lam * sq_dist(w, h)

    def fit(self, h: jax.Array, data, mask: jax.Array, key: jax.Array | None = None) -> jax.Array:
        x, y = data
        n = jnp.maximum(jnp.sum(mask), 1.0)
        xm = x * mask[:, None]
        a = (2.0 / n) * xm.T @ x + self.lam * jnp.eye(x.shape[1], dtype=x.dtype)
        rhs = (2.0 / n) * xm.T @ y + self.lam * h
        return jnp.linalg.solve(a, rhs)


def meta_gradient(learner, h: PyTree, data: PyTree, mask: jax.Array, key: jax.Array) -> PyTree:
    """∇L_Z(h) ≈ λ(h − ŵ_h(Z)) for one task."""
    w = learner.fit(h, data, mask, key)
    return jax.tree.map(lambda a, b: learner.lam * (a - b), h, w)
