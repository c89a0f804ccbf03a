"""Audits of the private selection mechanisms (`jdp.selection`): the exact privacy loss on worst-case neighbours.

A selection mechanism's output law is computable (`jdp.selection.probabilities`, exact to ~1e-10), so its audit
needs no sampling: for score vectors q and neighbours q' with |q'_a − q_a| ≤ Δ_a (every score moved by at most
its sensitivity; with `monotone=True`, all in the same direction), the mechanism is ε-DP only if
    max_o |log P[M(q) = o] − log P[M(q') = o]| ≤ ε.
`exact_audit` evaluates that maximum over a set of instances and, for each, the corners of the neighbour box
where the privacy loss peaks: each candidate o pushed down by Δ_o while every other rises by its Δ_a (and the
mirror image), and all scores up or all down (the only corners under `monotone=True`). The result is a lower
bound on the mechanism's ε (it holds for these neighbours; others could be worse), reported beside the ε of
the mechanism's `privacy_report`; a numerical tolerance (1e-8 in the log) is subtracted so that float64
rounding of an attained bound (kRR attains ε) never shows as a violation.

`sampled_audit` audits the sampler itself (`jdp.selection.select`): on the pair and output where the exact loss
peaks it draws the mechanism many times on both inputs and bounds ε from the frequencies of that output with
Clopper–Pearson intervals (`bounds.many_run_audit`).

Broken variants: "half-noise" (the law at 2ε, i.e. noise ×1/2, reported as ε), "monotone-misdeclared" (the
monotone, half-noise form of RNM / EM / PF run on neighbours whose scores move in both directions), and the
non-private reference "rnmh-nonprivate" (per-candidate noise 2Δ_a/ε, unbounded privacy loss) audited under
the ε it is called with.
"""
from __future__ import annotations

import jax
import numpy as np

from jdp import selection as S
from jdp.audit.bounds import AuditResult, RoutineAudit, many_run_audit
from jdp.validation import check_epsilon

VARIANTS = ("honest", "half-noise", "monotone-misdeclared")
MONOTONE = ("rnm-exp", "rnm-gumbel", "rnm-laplace", "em", "pf")  # mechanisms with a `monotone` option
LOG_TOLERANCE = 1e-8


def default_instances(k: int = 6, n: int = 40, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Score / sensitivity instances [n + 3, k]: random rows (scores of mixed spread, sensitivities 0.05..1) and
    three structured ones: all scores tied, one leader far ahead, and a tiny-Δ leader over a large-Δ runner-up
    (RNMH's counter-example)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, k)) * rng.uniform(0.1, 3.0, size=(n, 1))
    d = rng.uniform(0.05, 1.0, size=(n, k))
    tied = np.zeros(k)
    leader = np.r_[5.0, np.zeros(k - 1)]
    rnmh = np.r_[0.5, np.zeros(k - 1)]
    d_rnmh = np.r_[0.002, np.ones(k - 1)]
    return np.vstack([q, tied, leader, rnmh]), np.vstack([d, np.full(k, 0.5), np.full(k, 0.5), d_rnmh])


def worst_case_neighbours(scores: np.ndarray, sensitivities: np.ndarray, monotone: bool = False) -> np.ndarray:
    """Neighbours [n, c, k] of each instance [n, k]: corners q + s·Δ of the box |q' − q| ≤ Δ (module docstring)."""
    q = np.asarray(scores, np.float64)
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    k = q.shape[-1]
    signs = [np.ones(k), -np.ones(k)]
    if not monotone:
        for o in range(k):
            s = np.ones(k)
            s[o] = -1.0
            signs += [s, -s]
    s = np.stack(signs)  # [c, k]
    return q[:, None, :] + s[None] * d[:, None, :]


def reported_epsilon(name: str, epsilon: float, **params) -> float:
    """The ε the mechanism's `privacy_report` states for one selection (0 for 'uniform'; the ε it is called
    with for the non-private reference)."""
    if name in S.NONPRIVATE_REFERENCES:
        return float(epsilon)
    mech = S.get_mechanism(name)
    if mech.privacy == "none":
        return 0.0
    return float(S.privacy_report(name, epsilon, **params).pure_epsilon())


def _variant_name(name: str, variant: str) -> str:
    """The variant as recorded: a non-private reference is "non-private" whatever it was called with."""
    return "non-private" if name in S.NONPRIVATE_REFERENCES and variant == "honest" else variant


def _law(name: str, variant: str, epsilon: float, params: dict):
    """probabilities(q, d) of the mechanism as run by `variant`."""
    eps = 2.0 * epsilon if variant == "half-noise" else epsilon
    if variant == "monotone-misdeclared":
        if name not in MONOTONE:
            raise ValueError(f"variant 'monotone-misdeclared' needs a mechanism with a monotone option {MONOTONE}")
        params = {**params, "monotone": True}
    allow = name in S.NONPRIVATE_REFERENCES
    return lambda q, d: S.probabilities(name, q, d, eps, allow_nonprivate=allow, **params)


def _laws_on_neighbours(name, epsilon, scores, sensitivities, variant, params):
    """(q [n, k], d [n, k], neighbours [n, c, k], p [n, k], p' [n, c, k], monotone relation?)."""
    epsilon = check_epsilon(epsilon)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if scores is None:
        scores, sensitivities = default_instances(seed=0)   # public, fixed test instances
    q = np.asarray(scores, np.float64)
    if q.ndim != 2:
        raise ValueError(f"scores must be [instances, candidates], got shape {q.shape}")
    d = np.broadcast_to(np.asarray(sensitivities, np.float64), q.shape)
    monotone_relation = bool(params.get("monotone", False)) and variant != "monotone-misdeclared"
    nb = worst_case_neighbours(q, d, monotone=monotone_relation)  # [n, c, k]
    law = _law(name, variant, epsilon, params)
    p = law(q, d)
    p2 = law(nb.reshape(-1, q.shape[1]), np.repeat(d, nb.shape[1], axis=0)).reshape(nb.shape)
    return q, d, nb, p, p2, monotone_relation


def exact_audit(name: str, epsilon: float, scores=None, sensitivities=None, *, variant: str = "honest",
                **params) -> RoutineAudit:
    """The largest exact log-ratio of output probabilities over the worst-case neighbours of `scores`
    (default `default_instances(seed=0)`), beside the reported ε. Neighbours move every score by at most its Δ in any
    direction, or all in one direction when the mechanism runs with `monotone=True` (and the variant is not
    "monotone-misdeclared", which runs it so on neighbours that move both ways)."""
    q, d, nb, p, p2, monotone_relation = _laws_on_neighbours(name, epsilon, scores, sensitivities, variant, params)
    with np.errstate(divide="ignore", invalid="ignore"):
        loss = np.abs(np.log(p)[:, None, :] - np.log(p2))  # [n, c, k]
    loss = np.where(np.isnan(loss), 0.0, loss)  # 0/0: an output impossible on both sides
    i, c, o = np.unravel_index(int(np.argmax(loss)), loss.shape)
    worst = float(loss[i, c, o])
    result = AuditResult(max(0.0, worst - LOG_TOLERANCE) if np.isfinite(worst) else np.inf, 1.0, 0.0, "exact",
                         {"instances": int(q.shape[0]), "neighbours": int(nb.shape[0] * nb.shape[1]),
                          "worst_instance": int(i), "worst_neighbour": int(c), "worst_output": int(o),
                          "p": float(p[i, o]), "p_neighbour": float(p2[i, c, o])})
    setting = {"mechanism": name, "params": dict(params), "epsilon_parameter": float(epsilon),
               "relation": "monotone" if monotone_relation else "any direction"}
    return RoutineAudit(f"selection:{name} (exact)", _variant_name(name, variant),
                        reported_epsilon(name, epsilon, **params), result, setting)


def sampled_audit(name: str, epsilon: float, key: jax.Array, draws: int = 100_000, scores=None,
                  sensitivities=None, *, variant: str = "honest", confidence: float = 0.95,
                  **params) -> RoutineAudit:
    """Black-box audit of the sampler (`jdp.selection.select`): `draws` selections on an instance and on one
    of its worst-case neighbours, score 1 when the selection is a chosen output o; Clopper–Pearson bound at
    `confidence` (`bounds.many_run_audit`). (instance, neighbour, o) are chosen before sampling, from the exact
    laws: the triple whose bound would be largest if the frequencies came out at their means (normal
    approximation at two standard errors)."""
    q, d, nb, p, p2, monotone_relation = _laws_on_neighbours(name, epsilon, scores, sensitivities, variant, params)
    n = draws / 2.0  # the evaluation half of `many_run_audit`
    hi, lo = np.maximum(p[:, None, :], p2), np.minimum(p[:, None, :], p2)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.log(np.maximum(hi - 2 * np.sqrt(hi * (1 - hi) / n), 1e-300)
                          / (lo + 2 * np.sqrt(lo * (1 - lo) / n) + 1.0 / n))
    expected = np.where(np.isfinite(expected), expected, -np.inf)
    i, c, o = np.unravel_index(int(np.argmax(expected)), expected.shape)
    eps = 2.0 * epsilon if variant == "half-noise" else epsilon
    run_params = {**params, "monotone": True} if variant == "monotone-misdeclared" else params
    allow = name in S.NONPRIVATE_REFERENCES
    k1, k2 = jax.random.split(key)
    a = np.asarray(S.select(name, k1, np.tile(q[i], (draws, 1)), d[i], eps, allow_nonprivate=allow, **run_params))
    b = np.asarray(S.select(name, k2, np.tile(nb[i, c], (draws, 1)), d[i], eps, allow_nonprivate=allow,
                            **run_params))
    hit_a, hit_b = (a == o).astype(float), (b == o).astype(float)
    # o is likelier on the instance when p > p': the instance is then the "in" side of the test
    s_in, s_out = (hit_a, hit_b) if p[i, o] >= p2[i, c, o] else (hit_b, hit_a)
    # the public split of the draws into selection / evaluation halves, from the caller's key
    split_seed = int(jax.random.randint(jax.random.fold_in(key, 2), (), 0, 2 ** 31 - 1))
    result = many_run_audit(s_in, s_out, 0.0, confidence, seed=split_seed)
    result = AuditResult(result.epsilon_lower_bound, result.confidence, result.delta, result.method,
                         {**result.details, "instance": int(i), "neighbour": int(c), "output": int(o),
                          "p": float(p[i, o]), "p_neighbour": float(p2[i, c, o])})
    setting = {"mechanism": name, "params": dict(params), "epsilon_parameter": float(epsilon),
               "relation": "monotone" if monotone_relation else "any direction", "draws": int(draws)}
    return RoutineAudit(f"selection:{name} (sampled)", _variant_name(name, variant),
                        reported_epsilon(name, epsilon, **params), result, setting)


__all__ = ["LOG_TOLERANCE", "MONOTONE", "VARIANTS", "default_instances", "exact_audit", "reported_epsilon",
           "sampled_audit", "worst_case_neighbours"]
