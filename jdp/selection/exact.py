"""Exact output probabilities of noisy-max style mechanisms by 1-D Gauss-Legendre quadrature (float64).

For independent noisy values Y_j = q_j + Z_j with densities f_j and CDFs F_j,
    P[argmax = a] = ∫ f_a(y) Π_{j≠a} F_j(y) dy,
and for random stopping (best of K uniform draws, K with PGF Φ),
    P[output = a] = (1/k) ∫ f_a(y) Φ'(G(y)) dy,  G = (1/k) Σ_j F_j.
The integrands are log-concave and smooth between the kinks at y = q_j; the quadrature places
breakpoints at every q_j and on geometric ladders on both sides of it, scaled so that each panel sees
an O(1) change of the integrand's log (see `_nodes`); exponential noise with a common scale (RNM-exp,
permute-and-flip, GEM with base "pf") is integrated exactly as a polynomial (`exponential_common_scale`). Everything is
vectorised over leading batch axes; these are host-side NumPy routines used for noise-free utility
curves and for exact privacy tests, never on a private hot path.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

_UP = 2.0 ** np.arange(-3.0, 6.5)  # 0.125 .. 64 scales above each kink
_TAIL = 45.0  # integrate to q ± 45 b: tail mass e^{-45} is below float64 relevance for probabilities here
_GAUSS = np.polynomial.legendre.leggauss(16)
_MAX_ELEMENTS = 1 << 24  # nodes × candidates per chunk of rows (bounds memory)


def _rates_below(q: np.ndarray, b: np.ndarray) -> np.ndarray:
    """r_j = 1 / Σ_{i: q_i ≥ q_j} 1/b_i: just below q_j every integrand grows at most like e^{y/r_j}
    (each candidate above y contributes its CDF's slope 1/b_i), so panels there must be ~r_j wide."""
    above = q[..., None, :] >= q[..., :, None]  # [..., j, i]: q_i ≥ q_j
    return 1.0 / np.sum(np.where(above, 1.0 / b[..., None, :], 0.0), axis=-1)


def _nodes(q: np.ndarray, b: np.ndarray, two_sided: bool) -> tuple[np.ndarray, np.ndarray]:
    """Composite Gauss-Legendre nodes/weights [..., N] covering the support of max_j (q_j + Z_j).

    Breakpoints: every kink q_j; above it q_j + c·b_j (c = 1/8 … 64), where the CDF and density of
    candidate j vary on the scale b_j; for two-sided noise also below it q_j − r_j·2^n up to 45·b_j,
    where the integrands can grow like e^{(y − q_j)/r_j} (`_rates_below`; with a common scale r_j = b/m_j,
    m_j the number of scores ≥ q_j). Each panel then holds a log-concave piece whose log changes by O(1)
    per panel, which 16-point Gauss-Legendre integrates to ~1e-10 relative accuracy."""
    lo = q.min(-1, keepdims=True) - _TAIL * b.max(-1, keepdims=True) if two_sided else q.max(-1, keepdims=True)
    hi = (q + _TAIL * b).max(-1, keepdims=True)
    pts = [q, lo, hi, (q[..., None] + b[..., None] * _UP).reshape(*q.shape[:-1], -1)]
    if two_sided:
        r = _rates_below(q, b)
        steps = int(np.ceil(np.log2(_TAIL * np.max(b / r)))) + 3
        down = r[..., None] * 2.0 ** np.arange(-2.0, steps - 2.0)
        down = np.minimum(down, _TAIL * b[..., None])
        below = q[..., None] - down  # [..., k, steps]
        # Below another kink q_i < q_j with b_i ≥ b_j, candidate i's own ladder is at least as fine
        # (r_i ≤ r_j: more candidates lie above q_i) and reaches at least as far down (q_i − 45·b_i ≤
        # q_j − 45·b_j), so j's points there are redundant: they are replaced by the kink q_i itself.
        under = (q[..., None, :] < q[..., :, None]) & (b[..., None, :] >= b[..., :, None])  # [..., j, i]
        floor = np.max(np.where(under, q[..., None, :], -np.inf), axis=-1)  # highest such kink below q_j
        below = np.where(below < floor[..., None], floor[..., None], below)
        pts.append(below.reshape(*q.shape[:-1], -1))
    br = np.sort(np.clip(np.concatenate(pts, axis=-1), lo, hi), axis=-1)
    if br.ndim == 2 and br.shape[0] == 1:  # one row: drop repeated breakpoints (empty panels cost nodes)
        br = np.unique(br)[None]
    x, w = _GAUSS
    a, c = br[..., :-1, None], br[..., 1:, None]
    half = (c - a) / 2.0
    nodes = (a + half * (x + 1.0)).reshape(*q.shape[:-1], -1)
    weights = (half * w).reshape(*q.shape[:-1], -1)
    return nodes, weights


def _rows(q: np.ndarray, b: np.ndarray, fn: Callable) -> np.ndarray:
    """Applies fn(q [R, k], b [R, k]) -> [R, k] in chunks of rows (memory ~ nodes × k per row)."""
    lead, k = q.shape[:-1], q.shape[-1]
    qf, bf = q.reshape(-1, k), b.reshape(-1, k)
    per_row = 16 * 48 * k * k  # ≤ 48 breakpoints per candidate × 16 nodes, times k candidates
    chunk = max(1, _MAX_ELEMENTS // per_row)
    chunk = 1 if chunk < 4 else chunk  # large rows one at a time: `_nodes` then drops repeated breakpoints
    out = [fn(qf[i:i + chunk], bf[i:i + chunk]) for i in range(0, qf.shape[0], chunk)]
    return np.concatenate(out, 0).reshape(*lead, k) if out else np.zeros(q.shape)


def exponential_common_scale(scores, scale) -> np.ndarray:
    """Exact P[argmax_a (q_a + b·E_a) = a], E_a ~ Exp(1) iid, common scale b [..., 1] or scalar.

    With z = e^{−(y − q*)/b} and p_j = e^{(q_j − q*)/b} ∈ (0, 1] the integral becomes
    P[a] = p_a ∫_0^1 Π_{j≠a} (1 − p_j z) dz, a polynomial of degree k − 1 in z, which Gauss-Legendre
    with ⌈k/2⌉ + 1 nodes integrates exactly (up to rounding)."""
    q = np.asarray(scores, np.float64)
    b = np.broadcast_to(np.asarray(scale, np.float64), q.shape[:-1] + (1,)) if np.ndim(scale) else np.full(
        q.shape[:-1] + (1,), float(scale))
    k = q.shape[-1]
    x, w = np.polynomial.legendre.leggauss(k // 2 + 2)
    z, w = (x + 1.0) / 2.0, w / 2.0  # nodes in (0, 1)
    logp = (q - q.max(-1, keepdims=True)) / b  # ≤ 0
    p = np.exp(logp)
    # log(1 − p_j z) for every node: [..., n, k]; interior nodes keep 1 − p_j z > 0
    lg = np.log1p(-p[..., None, :] * z[:, None])
    total = lg.sum(-1, keepdims=True)
    inner = np.einsum("n,...na->...a", w, np.exp(total - lg))
    out = p * inner
    return out / out.sum(-1, keepdims=True)


def _log_cdf_pdf(y: np.ndarray, q: np.ndarray, b: np.ndarray, noise: str) -> tuple[np.ndarray, np.ndarray]:
    """log F_j(y) and f_j(y) for all nodes × candidates: [..., N, k]."""
    bb = b[..., None, :]
    if noise == "laplace":  # in place: these arrays are the quadrature's memory traffic
        x, half_tail = _laplace_standardised(y, q, b)
        below = x < 0
        logf = np.add(x, np.log(0.5))  # log(½e^{x}) = log ½ + x below q_j, finite however negative x is
        np.negative(half_tail, out=x)
        np.log1p(x, out=logf, where=~below)  # log(1 − ½e^{−x}) above it
        half_tail /= bb
        return logf, half_tail
    x = (y[..., :, None] - q[..., None, :]) / bb
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if noise == "exponential":
            pos = x > 0
            logf = np.where(pos, np.log(-np.expm1(-np.where(pos, x, 1.0))), -np.inf)
            pdf = np.where(pos, np.exp(-np.where(pos, x, 0.0)) / bb, 0.0)
        elif noise == "gumbel":
            logf = -np.exp(-x)
            pdf = np.exp(-x - np.exp(-x)) / bb
        else:
            raise ValueError(f"noise must be 'exponential', 'laplace' or 'gumbel', got {noise!r}")
    return logf, pdf


def _laplace_standardised(y: np.ndarray, q: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x = (y − q_j)/b_j and ½e^{−|x|} (the pdf's numerator and the smaller tail's mass) for all nodes ×
    candidates [..., N, k], with one exp per entry (the quadratures' cost is these transcendental calls)."""
    x = y[..., :, None] - q[..., None, :]
    x /= b[..., None, :]
    half_tail = np.abs(x)
    np.negative(half_tail, out=half_tail)
    np.exp(half_tail, out=half_tail)
    half_tail *= 0.5
    return x, half_tail


def _laplace_cdf_pdf(y: np.ndarray, q: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """F_j(y) and f_j(y) of Laplace(q_j, b_j) for all nodes × candidates: [..., N, k] (no log: random stopping
    needs the CDF itself)."""
    x, half_tail = _laplace_standardised(y, q, b)
    cdf = 1.0 - half_tail
    np.copyto(cdf, half_tail, where=x < 0)
    half_tail /= b[..., None, :]
    return cdf, half_tail


def noisy_max_probabilities(scores, scales, noise: str = "exponential") -> np.ndarray:
    """P[argmax_a (q_a + Z_a) = a] for independent Z_a with per-candidate scale b_a; [..., k] float64."""
    q = np.asarray(scores, np.float64)
    b = np.broadcast_to(np.asarray(scales, np.float64), q.shape)
    if noise == "exponential" and np.all(b == b[..., :1]):
        return exponential_common_scale(q, b[..., :1])
    return _rows(q, b, lambda qq, bb: _noisy_max(qq, bb, noise))


def _noisy_max(q, b, noise):
    y, w = _nodes(q, b, two_sided=noise != "exponential")
    logf, pdf = _log_cdf_pdf(y, q, b, noise)
    total = logf.sum(-1, keepdims=True)  # log Π_j F_j(y)
    with np.errstate(invalid="ignore"):  # in place: [..., N, k] arrays, the quadrature's memory traffic
        others = np.subtract(total, logf, out=logf)
        np.exp(others, out=others)  # Π_{j≠a} F_j(y)
    others[pdf <= 0] = 0.0  # only where f_a(y) > 0 (exponential noise: nothing below q_a)
    np.nan_to_num(others, copy=False)
    others *= pdf
    p = np.einsum("...n,...na->...a", w, others)
    return p / p.sum(-1, keepdims=True)


def random_stopping_probabilities(scores, scales, dpgf: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """P[output = a] of best-of-K uniform draws with Laplace(q_j, b_j) values; dpgf = Φ' of K."""
    q = np.asarray(scores, np.float64)
    b = np.broadcast_to(np.asarray(scales, np.float64), q.shape)
    return _rows(q, b, lambda qq, bb: _random_stopping(qq, bb, dpgf))


def _random_stopping(q, b, dpgf):
    k = q.shape[-1]
    y, w = _nodes(q, b, two_sided=True)
    cdf, pdf = _laplace_cdf_pdf(y, q, b)
    g = cdf.mean(-1)  # [..., N]
    p = np.einsum("...n,...na->...a", w * dpgf(g), pdf) / k
    return p / p.sum(-1, keepdims=True)
