"""Re-Attention (DPFormer §4, Algorithm 1): effective errors, variance propagation, logit correction.

DP-SGD noise makes every parameter a noisy estimate of its noise-free value. A key K_i with
per-coordinate variance σ_i² inflates E[exp<q, K_i>] by exp(Σ_k q_k² σ_ik² / 2), so attention drifts
towards high-variance (rare) tokens. Re-Attention tracks these variances through the network by
moment matching and subtracts ½ Σ_k q_k² Var[K_ik] / d_h from each (1/sqrt(d_h)-scaled) logit.

Effective error (paper Claims 4.3/4.4), noise std per coordinate of the *averaged* noisy gradient:
  block weights (dense, LayerNorm, positions): σ_eff = σ_dp·C / B
  embedding row i:                             σ_eff,i = σ_dp·C / (B·p_i) = σ_dp·C / (q·c_i)
with B = q·N the expected batch size and c_i the number of training sequences containing item i.
`error_scale` multiplies both (1 = the paper's instantiation, which ignores the learning rate).

Propagation rules (means = the actual forward activations, i.e. the noisy weights serve as estimates
of their means, as in the paper; all variances are constants: stop_gradient):
- linear y = xW + b: Var[y_j] = Σ_i (Var[x_i] Var[W] + x_i² Var[W] + W_ij² Var[x_i]) + Var[b]   (eq. 7)
- ReLU: exact Gaussian moments of max(0, X) (Lemma A.4).
- GELU: Gaussian moments by Gauss-Hermite quadrature (20 nodes), not the paper's ReLU stand-in.
- LayerNorm (the paper is silent): first-order (delta-method) rule with the exact LN Jacobian,
  J = (γ/s)(I − 11ᵀ/d − x̂x̂ᵀ/d), Var[y_j] = Σ_i J_ji² Var[x_i] + x̂_j² Var[γ] + Var[β].
- residual: variances add (branches treated as independent).
- attention output o = A V: Var[o] = A² Var[V] (attention weights treated as constants); heads are
  split per coordinate, so each head sees its own coordinates' variances.
- dropout is ignored in the propagation (the variance of the noise-free-dropout network is tracked).
- positional embeddings count as block weights.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp import accounting
from jdp.noise import gaussian_histogram
from jdp.validation import check_positive

_SQRT2 = math.sqrt(2.0)
_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(20)  # probabilists' Hermite: weight exp(-x²/2)
_GH_W = _GH_W / _GH_W.sum()


def _phi(x):
    return jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x):
    return 0.5 * (1.0 + jax.lax.erf(x / _SQRT2))


def relu_moments(mu: jax.Array, var: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E, Var) of max(0, X), X ~ N(mu, var) elementwise (exact; var = 0 gives (relu(mu), 0))."""
    s = jnp.sqrt(jnp.maximum(var, 0.0))
    safe = jnp.maximum(s, 1e-20)
    g = mu / safe
    mean = jnp.where(s > 0, mu * _Phi(g) + s * _phi(g), jnp.maximum(mu, 0.0))
    second = jnp.where(s > 0, (mu * mu + var) * _Phi(g) + mu * s * _phi(g), jnp.maximum(mu, 0.0) ** 2)
    return mean, jnp.maximum(second - mean * mean, 0.0)


def gelu_moments(mu: jax.Array, var: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E, Var) of GELU(X) = X·Φ(X), X ~ N(mu, var), by 20-node Gauss-Hermite quadrature."""
    s = jnp.sqrt(jnp.maximum(var, 0.0))[..., None]
    x = mu[..., None] + s * jnp.asarray(_GH_X, mu.dtype)
    f = jax.nn.gelu(x, approximate=False)
    w = jnp.asarray(_GH_W, mu.dtype)
    mean = (f * w).sum(-1)
    return mean, jnp.maximum((f * f * w).sum(-1) - mean * mean, 0.0)


def activation_moments(name: str, mu: jax.Array, var: jax.Array) -> tuple[jax.Array, jax.Array]:
    if name == "relu":
        return relu_moments(mu, var)
    if name == "gelu":
        return gelu_moments(mu, var)
    raise ValueError(f"activation must be 'relu' or 'gelu', got {name!r}")


def linear_var(x: jax.Array, var_x: jax.Array, kernel: jax.Array, w_var: jax.Array | float,
               bias: bool = True) -> jax.Array:
    """Var of x @ W (+ b) for independent x [..., p] (variance var_x) and W [p, q] with iid Var[W] = w_var.

    Eq. (7) summed over the contraction: w_var·Σ_i (var_x_i + x_i²) + var_x @ W² (+ w_var for b)."""
    kernel = kernel.reshape(kernel.shape[0], -1)
    out = w_var * (var_x + x * x).sum(-1, keepdims=True) + var_x @ (kernel * kernel)
    return out + w_var if bias else out


def layernorm_var(x: jax.Array, var_x: jax.Array, scale: jax.Array | None, w_var: jax.Array | float,
                  eps: float = 1e-6, bias: bool = True) -> jax.Array:
    """First-order Var of LayerNorm(x) over the last axis (exact LN Jacobian, diagonal input variance).

    With x̂ = (x − mean)/s, s = sqrt(var + eps) and J = (γ/s)(I − 11ᵀ/d − x̂x̂ᵀ/d):
      Σ_i J_ji² v_i = (γ_j²/s²)[v_j(1 − 2/d − 2x̂_j²/d) + (S0 + 2x̂_j S1 + x̂_j² S2)/d²],
    S0 = Σv, S1 = Σ v x̂, S2 = Σ v x̂²; plus x̂_j² Var[γ] + Var[β] for the noisy affine parameters.
    """
    d = x.shape[-1]
    mean = x.mean(-1, keepdims=True)
    s2 = ((x - mean) ** 2).mean(-1, keepdims=True) + eps
    xh = (x - mean) / jnp.sqrt(s2)
    s0 = var_x.sum(-1, keepdims=True)
    s1 = (var_x * xh).sum(-1, keepdims=True)
    s2v = (var_x * xh * xh).sum(-1, keepdims=True)
    core = var_x * (1.0 - 2.0 / d - 2.0 * xh * xh / d) + (s0 + 2 * xh * s1 + xh * xh * s2v) / d ** 2
    g2 = 1.0 if scale is None else scale * scale
    out = g2 * core / s2
    if scale is not None:
        out = out + w_var * xh * xh
    return out + w_var if bias else out


def attention_logit_correction(q: jax.Array, var_k: jax.Array) -> jax.Array:
    """½ Σ_k q_k² Var[K_jk] / d_h for logits q·k/sqrt(d_h).

    q: [..., Lq, H, dh]; var_k: [..., Lk, H, dh] -> [..., H, Lq, Lk] (subtract from the logits)."""
    dh = q.shape[-1]
    return 0.5 * jnp.einsum("...qhd,...khd->...hqk", q * q, var_k) / dh


def effective_variances(noise_multiplier: float, l2_clip: float, batch_size: float, sampling_rate: float,
                        item_counts: np.ndarray, error_scale: float = 1.0,
                        min_count: float = 1.0) -> tuple[float, np.ndarray]:
    """(w_var, emb_var [M+1]): squared effective errors of block weights and item-embedding rows.

    item_counts[i]: (noisy or public) number of training sequences containing item i; floored at
    `min_count` (noisy counts can be ≤ 0). emb_var_i = (σ C / (q c_i))², w_var = (σ C / B)².
    Padding row 0 gets variance 0 (its embedding is masked out).
    """
    check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
    check_positive(l2_clip, "l2_clip")
    check_positive(batch_size, "batch_size")
    check_positive(sampling_rate, "sampling_rate")
    check_positive(min_count, "min_count")
    counts = np.asarray(item_counts, np.float64)
    if counts.ndim != 1 or not np.isfinite(counts).all():
        raise ValueError("item_counts must be a finite 1-d array")
    std = error_scale * noise_multiplier * l2_clip
    w_var = (std / batch_size) ** 2
    emb_var = (std / (sampling_rate * np.maximum(counts, min_count))) ** 2
    emb_var[0] = 0.0
    return float(w_var), emb_var.astype(np.float32)


def private_item_counts(key: jax.Array, exact_counts: np.ndarray, max_items_per_user: int,
                        noise_multiplier: float, report: accounting.PrivacyReport,
                        name: str = "item frequency histogram") -> np.ndarray:
    """Gaussian-noised per-item user counts, recorded in `report`.

    Unit: one user (one training sequence); relation: add/remove a user. Each user adds 1 to at most
    `max_items_per_user` distinct items, so the L2 sensitivity is sqrt(max_items_per_user); noise std
    = noise_multiplier · sqrt(max_items_per_user). Index 0 (padding) is released as 0 (data-independent).
    """
    check_positive(noise_multiplier, "noise_multiplier")
    if max_items_per_user < 1:
        raise ValueError(f"max_items_per_user must be >= 1, got {max_items_per_user}")
    counts = np.asarray(exact_counts, np.float64)
    if counts.ndim != 1 or counts.size < 2 or not np.isfinite(counts).all():
        raise ValueError("exact_counts must be a finite 1-d array with a padding entry")
    sens = math.sqrt(max_items_per_user)
    report.add_gaussian(name, sensitivity=sens, noise_std=noise_multiplier * sens)
    out = gaussian_histogram(key, counts, noise_multiplier * sens)
    out[0] = 0.0
    return out


__all__ = ["activation_moments", "attention_logit_correction", "effective_variances", "gelu_moments",
           "layernorm_var", "linear_var", "private_item_counts", "relu_moments"]
