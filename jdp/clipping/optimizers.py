"""Optimisers for noisy DP gradients, as optax transformations (post-processing of the DP-SGD release).

`dp_aggregate` hands the optimiser the noisy mean g̃ = ḡ + z with z ~ N(0, φ·I), φ = (σ·S/B)² per coordinate
(noise multiplier σ, sensitivity S, expected batch size B): a PUBLIC quantity, `noise_variance(...)`.

DP-AdamBC (Tang, Shpilevskiy & Lécuyer, AAAI 2024). Adam's second moment estimates E[g̃²] = ḡ² + φ, so on a
coordinate the noise dominates Adam divides by ≈ √φ and moves it by about its step size whatever the noise (its
update m̂/√v̂ has a fixed scale): the noise walk that keeps a DP Transformer's item rows near their random start.
AdamBC removes the bias: update = m̂ / √max(v̂ − φ, γ). Where ḡ² ≫ φ it is Adam; where the noise dominates it is
momentum SGD scaled by 1/√γ, whose noise walk is √(φ/γ) of Adam's (γ = φ: the same scale as Adam there; the
default γ = 10 φ: about a third of it). γ is a hyper-parameter in units of φ (`gamma_over_noise`), so a default
derived from public quantities means the same at every σ, S and B.

DP-SGD with momentum needs nothing new: `optax.sgd(lr, momentum=β)` after `dp_aggregate`.
Neither reads the data: privacy is the DP-SGD release's (the optimiser only post-processes it).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp.validation import check_positive


def noise_variance(noise_multiplier: float, sensitivity: float, expected_batch_size: float) -> float:
    """φ = (σ·S/B)²: the variance per coordinate of the noise in `dp_aggregate`'s noisy mean (public)."""
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    s = check_positive(sensitivity, "sensitivity")
    b = check_positive(expected_batch_size, "expected_batch_size")
    return float((sigma * s / b) ** 2)


class ScaleByAdamBCState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam_bc(noise_var: float, b1: float = 0.9, b2: float = 0.999, gamma_over_noise: float = 10.0,
                     eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's scaling with the known noise variance `noise_var` (φ) removed from the second moment:
    m̂ / (√max(v̂ − φ, γ) + eps), γ = gamma_over_noise · φ (module docstring); φ = 0 (no noise, e.g. a NON-PRIVATE
    reference run) is Adam itself. Moments are kept in float32."""
    phi = check_positive(noise_var, "noise_var", allow_zero=True)
    eps = check_positive(eps, "eps", allow_zero=True)
    gamma = check_positive(gamma_over_noise, "gamma_over_noise") * phi
    for name, b in (("b1", b1), ("b2", b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")

    def init_fn(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return ScaleByAdamBCState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update_fn(updates, state, params=None):
        del params
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, g32)
        nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, g32)
        count = state.count + 1
        t = count.astype(jnp.float32)
        c1, c2 = 1.0 - b1 ** t, 1.0 - b2 ** t

        def step(m, v, g):
            return ((m / c1) / (jnp.sqrt(jnp.maximum(v / c2 - phi, gamma)) + eps)).astype(g.dtype)

        return jax.tree.map(step, mu, nu, updates), ScaleByAdamBCState(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def dp_adam_bc(learning_rate: optax.ScalarOrSchedule, noise_var: float, b1: float = 0.9, b2: float = 0.999,
               gamma_over_noise: float = 10.0, eps: float = 1e-8, weight_decay: float = 0.0
               ) -> optax.GradientTransformation:
    """DP-AdamBC with decoupled weight decay (AdamW's), to put after `dp_aggregate` (as `dp_sgd`'s optimizer)."""
    parts = [scale_by_adam_bc(noise_var, b1, b2, gamma_over_noise, eps)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(check_positive(weight_decay, "weight_decay")))
    lr = learning_rate if callable(learning_rate) else check_positive(learning_rate, "learning_rate")
    parts.append(optax.scale_by_learning_rate(lr))
    return optax.chain(*parts)


__all__ = ["ScaleByAdamBCState", "dp_adam_bc", "noise_variance", "scale_by_adam_bc"]
