"""Exact output probabilities of noisy-max style mechanisms by 1-D Gauss-Legendre quadrature (float64).

For independent noisy values Y_j = q_j + Z_j with densities f_j and CDFs F_j,
    P[argmax = a] = ∫ f_a(y) Π_{j≠a} F_j(y) dy,
and for random stopping (best of K uniform draws, K with PGF Φ),
    P[output = a] = (1/k) ∫ f_a(y) Φ'(G(y)) dy,  G = (1/k) Σ_j F_j.
The integrands are smooth between the kinks at y = q_j; the quadrature places breakpoints at every q_j
and at q_j ± c·b_j for a geometric ladder of c so narrow densities are resolved. Everything is
vectorised over leading batch axes; these are host-side NumPy routines used for noise-free utility
curves and for exact privacy tests, never on a private hot path.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

_LADDER = np.array([0.25, 1.0, 3.0, 8.0, 20.0, 45.0])
_TAIL = 45.0  # integrate to q ± 45 b: tail mass e^{-45} is below float64 relevance for probabilities here
_GAUSS = np.polynomial.legendre.leggauss(8)


def _nodes(q: np.ndarray, b: np.ndarray, two_sided: bool) -> tuple[np.ndarray, np.ndarray]:
    """Quadrature nodes/weights [..., N] covering the support of max_j (q_j + Z_j)."""
    lo = q.min(-1, keepdims=True) - (_TAIL * b.max(-1, keepdims=True) if two_sided else 0.0)
    hi = (q + _TAIL * b).max(-1, keepdims=True)
    if np.all(b == b[..., :1]):  # common scale: integrands are smooth between the q_j, refine the top only
        top = q.max(-1, keepdims=True)
        pts = [top[..., None] + b[..., :1, None] * _LADDER]
        if two_sided:
            pts.append(q.min(-1, keepdims=True)[..., None] - b[..., :1, None] * _LADDER)
    else:
        pts = [q[..., None] + b[..., None] * _LADDER]
        if two_sided:
            pts.append(q[..., None] - b[..., None] * _LADDER)
    br = np.concatenate([q, lo, hi] + [p.reshape(*q.shape[:-1], -1) for p in pts], axis=-1)
    br = np.sort(np.clip(br, lo, hi), axis=-1)
    x, w = _GAUSS
    a, c = br[..., :-1, None], br[..., 1:, None]
    half = (c - a) / 2.0
    nodes = (a + half * (x + 1.0)).reshape(*q.shape[:-1], -1)
    weights = (half * w).reshape(*q.shape[:-1], -1)
    return nodes, weights


def _log_cdf_pdf(y: np.ndarray, q: np.ndarray, b: np.ndarray, noise: str) -> tuple[np.ndarray, np.ndarray]:
    """log F_j(y) and f_j(y) for all nodes × candidates: [..., N, k]."""
    x = (y[..., :, None] - q[..., None, :]) / b[..., None, :]
    bb = b[..., None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if noise == "exponential":
            pos = x > 0
            logf = np.where(pos, np.log(-np.expm1(-np.where(pos, x, 1.0))), -np.inf)
            pdf = np.where(pos, np.exp(-np.where(pos, x, 0.0)) / bb, 0.0)
        elif noise == "laplace":
            logf = np.where(x < 0, np.log(0.5) + np.minimum(x, 0.0), np.log1p(-0.5 * np.exp(-np.maximum(x, 0.0))))
            pdf = 0.5 * np.exp(-np.abs(x)) / bb
        elif noise == "gumbel":
            logf = -np.exp(-x)
            pdf = np.exp(-x - np.exp(-x)) / bb
        else:
            raise ValueError(f"noise must be 'exponential', 'laplace' or 'gumbel', got {noise!r}")
    return logf, pdf


def noisy_max_probabilities(scores, scales, noise: str = "exponential") -> np.ndarray:
    """P[argmax_a (q_a + Z_a) = a] for independent Z_a with per-candidate scale b_a; [..., k] float64."""
    q = np.asarray(scores, np.float64)
    b = np.broadcast_to(np.asarray(scales, np.float64), q.shape)
    y, w = _nodes(q, b, two_sided=noise != "exponential")
    logf, pdf = _log_cdf_pdf(y, q, b, noise)
    total = logf.sum(-1, keepdims=True)  # log Π_j F_j(y)
    with np.errstate(invalid="ignore"):
        others = np.where(pdf > 0, np.exp(total - logf), 0.0)  # Π_{j≠a} F_j(y), where f_a(y) > 0
    p = np.einsum("...n,...na->...a", w, pdf * np.nan_to_num(others))
    return p / p.sum(-1, keepdims=True)


def random_stopping_probabilities(scores, scales, dpgf: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """P[output = a] of best-of-K uniform draws with Laplace(q_j, b_j) values; dpgf = Φ' of K."""
    q = np.asarray(scores, np.float64)
    b = np.broadcast_to(np.asarray(scales, np.float64), q.shape)
    k = q.shape[-1]
    y, w = _nodes(q, b, two_sided=True)
    logf, pdf = _log_cdf_pdf(y, q, b, "laplace")
    g = np.exp(logf).mean(-1)  # [..., N]
    p = np.einsum("...n,...na->...a", w * dpgf(g), pdf) / k
    return p / p.sum(-1, keepdims=True)
