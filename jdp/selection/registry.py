"""The mechanism registry: each selection mechanism as data, its exact probabilities and privacy bookkeeping.

`PRIVATE_MECHANISMS` maps names to ε-DP mechanisms; `NONPRIVATE_REFERENCES` holds RNMH, which is not
DP and can only be reached under its explicit name "rnmh-nonprivate" (never a default). Each `Mechanism`
holds its sampler, its exact output law, its parameters and its privacy (`privacy`: what one selection at
ε releases, from which `dp_event` is derived). Running a mechanism on a batch is `jdp.selection.batched`.

    p = probabilities("gem", scores, sensitivities, epsilon)                     # float64 [B, k]
    event = PRIVATE_MECHANISMS["gem"].dp_event(epsilon)                          # dp_accounting
    report = privacy_report("gem", epsilon, count=B)

Numerics (offset invariance, exactness): every mechanism's output law depends on the scores only
through their differences within a row (noisy max, EM, PF and RS_γ compare q_a + noise across a row;
kRR uses the argmax; GEM's s_a uses q_a − q_b; combined GEM's Spearman bit uses ranks), so subtracting
each row's maximum leaves every law unchanged. Rows whose range is too large for float64 relative to the
sensitivities are rejected (`check_range`). `probabilities` applies the shift and check on the host.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
import numpy as np
from dp_accounting import dp_event as dpe

from jdp.accounting import ADD_OR_REMOVE_ONE, PrivacyReport, Relation, pure_dp_event
from jdp.selection import baselines, rnm
from jdp.selection import generalized_em as gem_mod
from jdp.selection import random_stop as rs_mod
from jdp.validation import check_epsilon, check_open_unit, check_scores


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A selection mechanism: `sample(key, scores, sensitivities, epsilon, **params) -> int32 index`,
    `probabilities(scores, sensitivities, epsilon, **params) -> float64 [..., k]`.

    batch_native: `sample` accepts leading batch axes directly (one key, no per-row split);
    otherwise `select` vmaps it over rows with split keys."""
    name: str
    sample: Callable
    exact_probabilities: Callable
    params: tuple[str, ...] = ()
    batch_native: bool = True
    description: str = ""
    # what the float64 rounding of the shifted scores is compared with (see `check_range`): "max" for the
    # homogeneous mechanisms (calibrated to Δ = max Δ_a), "min" for the per-candidate ones (GEM family,
    # RS_γ), None where any function of the scores is private (kRR, uniform) or nothing is promised (RNMH)
    resolution: str | None = "max"
    # what one selection at ε releases: "pure" (one ε-DP release), "split" (two pure releases at split·ε
    # and (1 − split)·ε: combined GEM's correlation bit and its GEM/mGEM run), "none" (reads no data: 0-DP),
    # "not-private" (no guarantee; RNMH)
    privacy: str = "pure"

    def check_params(self, params: dict) -> dict:
        unknown = set(params) - set(self.params)
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)} for mechanism {self.name!r}; "
                             f"allowed: {list(self.params)}")
        params = dict(params)
        if "beta" in params:
            params["beta"] = check_open_unit(params["beta"], "beta")
        if "gamma" in params and params["gamma"] is not None:
            params["gamma"] = check_open_unit(params["gamma"], "gamma")
        if "split" in params:
            params["split"] = check_open_unit(params["split"], "split")
        if "eta" in params:
            eta = float(params["eta"])
            if not (np.isfinite(eta) and eta >= 0):
                raise ValueError(f"eta must be finite and >= 0, got {params['eta']!r}")
            params["eta"] = eta
        if "stopping" in params and params["stopping"] not in ("geometric", "tnb"):
            raise ValueError(f"stopping must be 'geometric' or 'tnb', got {params['stopping']!r}")
        if "base" in params and params["base"] not in ("em", "pf"):
            raise ValueError(f"base must be 'em' or 'pf', got {params['base']!r}")
        if "shift" in params and params["shift"] is not None and not np.isfinite(float(params["shift"])):
            raise ValueError(f"shift must be a finite public number, got {params['shift']!r}")
        return params

    def guaranteed_epsilon(self, epsilon: float) -> float:
        """The privacy loss one run calibrated to ε on scores can reach, float64 rounding included:
        ε·(1 + LOSS_SLACK) where the rounding of the shifted scores can enlarge a sensitivity (every mechanism
        that compares scores, `resolution` set; see `check_range`), ε where any function of the scores is
        private (kRR, uniform)."""
        epsilon = check_epsilon(epsilon)
        return epsilon * (1.0 + LOSS_SLACK) if self.resolution is not None else epsilon

    def dp_event(self, epsilon: float, **params) -> dpe.DpEvent:
        """The dp_accounting event of one selection at parameter ε: pure DP at `guaranteed_epsilon(ε)`, the
        bound that holds for the float64 computation (ε·(1 + 2⁻¹²) for the score-comparing mechanisms).
        Combined GEM: its randomized-response bit at split·ε (a bit of any function of the scores: no
        rounding term) and its GEM/mGEM run at the guaranteed bound of (1 − split)·ε."""
        if self.privacy == "not-private":
            raise ValueError(f"{self.name!r} is NOT differentially private: it has no dp_event")
        epsilon = check_epsilon(epsilon)
        params = self.check_params(params)
        if self.privacy == "none":
            return dpe.NoOpDpEvent()
        if self.privacy == "split":
            split = params.get("split", 0.5)
            return dpe.ComposedDpEvent([pure_dp_event(split * epsilon),
                                        pure_dp_event(self.guaranteed_epsilon((1 - split) * epsilon))])
        return pure_dp_event(self.guaranteed_epsilon(epsilon))

    @property
    def private(self) -> bool:
        return self.privacy != "not-private"

    def probabilities(self, scores, sensitivities, epsilon, **params) -> np.ndarray:
        """Exact output probabilities [..., k] (float64) of `select`: like `select`, each row's maximum
        is subtracted in float64 first (the laws depend on score differences only) and rows whose
        range float64 cannot resolve are rejected."""
        check_scores(scores, sensitivities)
        epsilon = check_epsilon(epsilon)
        params = self.check_params(params)
        q = np.asarray(scores, np.float64)
        q = q - q.max(-1, keepdims=True)
        d = np.asarray(sensitivities, np.float64)
        check_range(self, q, d, epsilon, params)
        return self.exact_probabilities(q, d, epsilon, **params)


# Rounding the shifted scores (and, for GEM, q_a − tΔ_a) to float64 perturbs each by η ≤ 2·u·M (u = 2⁻⁵³,
# M = the largest magnitude rounded). A deterministic perturbation of size η turns a sensitivity Δ into
# Δ + 2η, so the realised privacy loss is at most ε·(1 + 2η/Δ); `check_range` demands 2η/Δ ≤ 2⁻¹², i.e.
# M ≤ 2³⁸·Δ (Δ = max Δ_a or min Δ_a, see `Mechanism.resolution`). Beyond that a ValueError is raised.
# That bound, ε·(1 + LOSS_SLACK), is what `Mechanism.dp_event` records (`guaranteed_epsilon`).
_UNIT_ROUNDOFF = 2.0 ** -53
LOSS_SLACK = 2.0 ** -12
_LOSS_SLACK = LOSS_SLACK
# The argument above assumes relative rounding, which holds for normal floats only: a noise scale Δ/ε near
# float64's subnormal range (below 2⁻¹⁰²²) is rounded by an absolute step that can exceed any Δ (a scale of
# 1.25·2⁻¹⁰⁷⁴ rounds to 2⁻¹⁰⁷⁴), and one near overflow loses the scores' resolution. Every Δ_a/ε must lie in
# [2⁻⁹⁶⁰, 2⁹⁶⁰], which leaves 62 binary orders of headroom on both sides for the mechanisms' own products.
_SCALE_RANGE = (2.0 ** -960, 2.0 ** 960)


def _gem_shift_magnitude(mech: Mechanism, k: int, epsilon: float, params: dict) -> float:
    """|t| of the GEM family (0 for the other mechanisms): q_a − tΔ_a is rounded at the scale |t|·max Δ."""
    if mech.name not in ("gem", "mgem", "combined-gem"):
        return 0.0
    if params.get("shift") is not None:
        return abs(float(params["shift"]))
    eps = epsilon * (1.0 - params.get("split", 0.5)) if mech.name == "combined-gem" else epsilon
    return abs(gem_mod.default_shift(k, eps, params.get("beta", 0.5)))


def range_violations(mech: Mechanism, shifted, sensitivities, epsilon: float, params: dict):
    """Boolean [...] per row: True where float64 cannot represent the row's range finely enough
    (`_UNIT_ROUNDOFF`·magnitude > `_LOSS_SLACK`/4 · Δ) or some noise scale Δ_a/ε is not a normal float
    (`scale_violations`). `shifted`: scores minus their row maximum (numpy or jax arrays; jax inside `select`'s
    float64 pass)."""
    t = _gem_shift_magnitude(mech, shifted.shape[-1], epsilon, params)
    return resolution_violations(shifted, sensitivities, t, epsilon, mech.resolution)


def resolution_violations(shifted, sensitivities, t_abs, epsilon, resolution: str):
    """`range_violations` with the GEM shift |t| given (traceable in everything but `resolution`)."""
    xp = np if isinstance(shifted, np.ndarray) else jnp
    d = xp.broadcast_to(sensitivities, shifted.shape)
    ref = xp.max(d, axis=-1) if resolution == "max" else xp.min(d, axis=-1)
    magnitude = -xp.min(shifted, axis=-1) + t_abs * xp.max(d, axis=-1)
    return (4.0 * _UNIT_ROUNDOFF * magnitude > _LOSS_SLACK * ref) | scale_violations(d, epsilon)


def scale_violations(sensitivities, epsilon: float):
    """Boolean [...] per row: True where some noise scale Δ_a/ε leaves [2⁻⁹⁶⁰, 2⁹⁶⁰] (see `_SCALE_RANGE`)."""
    xp = np if isinstance(sensitivities, np.ndarray) else jnp
    return ((xp.min(sensitivities, axis=-1) < _SCALE_RANGE[0] * epsilon)
            | (xp.max(sensitivities, axis=-1) > _SCALE_RANGE[1] * epsilon))


def check_range(mech: Mechanism, shifted, sensitivities, epsilon: float, params: dict) -> None:
    """ValueError naming `scores` when some row's range cannot be resolved (see `range_violations`)."""
    if mech.resolution is None:
        return
    d_all = np.broadcast_to(np.asarray(sensitivities, np.float64), np.shape(shifted))
    small = np.asarray(scale_violations(d_all, epsilon))
    if small.any():
        row = np.unravel_index(int(np.argmax(small)), small.shape) if small.ndim else ()
        raise ValueError(
            f"sensitivities: row {tuple(int(i) for i in row)} has a noise scale Δ/ε outside "
            f"[{_SCALE_RANGE[0]:.3g}, {_SCALE_RANGE[1]:.3g}] (Δ in [{d_all[row].min():.6g}, {d_all[row].max():.6g}], "
            f"ε = {epsilon:.6g}): float64 cannot round such scales relatively, so the privacy loss could exceed ε. "
            f"Rescale scores and sensitivities together (the selection does not change)")
    bad = np.asarray(range_violations(mech, np.asarray(shifted, np.float64), np.asarray(sensitivities, np.float64),
                                      epsilon, params))
    if bad.any():
        row = np.unravel_index(int(np.argmax(bad)), bad.shape) if bad.ndim else ()
        q = np.asarray(shifted, np.float64)[row]
        d = np.broadcast_to(np.asarray(sensitivities, np.float64), np.shape(shifted))[row]
        ref = d.max() if mech.resolution == "max" else d.min()
        raise ValueError(
            f"scores: row {tuple(int(i) for i in row)} spans a range of {-q.min():.6g} (plus |t|·max Δ for GEM), "
            f"more than float64 resolves for its sensitivities ({mech.resolution} Δ = {ref:.6g}): rounding could "
            f"move the privacy loss by more than {_LOSS_SLACK:.3g}·ε. Keep every row's range below "
            f"{_LOSS_SLACK / (4 * _UNIT_ROUNDOFF):.3g}·Δ (clip scores to a data-independent range, or raise Δ)")


def _m(name, sample, probs, params=(), **kw):
    return Mechanism(name, sample, probs, tuple(params), **kw)


_MONO = ("monotone",)
_GEM = ("beta", "shift", "base")
PRIVATE_MECHANISMS: dict[str, Mechanism] = {
    "rnm-exp": _m("rnm-exp", rnm.rnm_exponential, rnm.rnm_exponential_probabilities, _MONO,
                  description="report-noisy-max, exponential noise 2Δ/ε (= permute-and-flip)"),
    "rnm-gumbel": _m("rnm-gumbel", rnm.rnm_gumbel, rnm.rnm_gumbel_probabilities, _MONO,
                     description="report-noisy-max, Gumbel noise 2Δ/ε (= exponential mechanism)"),
    "rnm-laplace": _m("rnm-laplace", rnm.rnm_laplace, rnm.rnm_laplace_probabilities, _MONO,
                      description="report-noisy-max, Laplace noise 2Δ/ε"),
    "em": _m("em", rnm.exponential_mechanism, rnm.exponential_mechanism_probabilities, _MONO,
             description="exponential mechanism exp(εq/(2Δ))"),
    "pf": _m("pf", rnm.permute_and_flip, rnm.permute_and_flip_probabilities, _MONO,
             description="permute-and-flip"),
    "krr": _m("krr", baselines.krr, baselines.krr_probabilities, resolution=None,
              description="k-ary randomized response on the exact argmax"),
    "uniform": _m("uniform", baselines.uniform, baselines.uniform_probabilities, resolution=None, privacy="none",
                  description="uniformly random candidate (0-DP reference)"),
    "rs-geometric": _m("rs-geometric", functools.partial(rs_mod.random_stopping, stopping="geometric"),
                       functools.partial(rs_mod.random_stopping_probabilities, stopping="geometric"),
                       ("gamma", "block"), batch_native=False, resolution="min",
                       description="random stopping, K ~ Geometric(γ), heterogeneous Laplace, ε' = ε/3"),
    "rs-tnb": _m("rs-tnb", functools.partial(rs_mod.random_stopping, stopping="tnb"),
                 functools.partial(rs_mod.random_stopping_probabilities, stopping="tnb"),
                 ("gamma", "eta", "block"), batch_native=False, resolution="min",
                 description="random stopping, K ~ TNB(η, γ), heterogeneous Laplace, ε' = ε/(2+η)"),
    "gem": _m("gem", gem_mod.gem, gem_mod.gem_probabilities, _GEM + ("frontier_size",), batch_native=False,
              resolution="min", description="generalised exponential mechanism, t = 2 ln(k/β)/ε"),
    "mgem": _m("mgem", gem_mod.mgem, gem_mod.mgem_probabilities, _GEM + ("frontier_size",), batch_native=False,
               resolution="min", description="modified GEM, t = −2 ln(k/β)/ε"),
    "combined-gem": _m("combined-gem", gem_mod.combined_gem, gem_mod.combined_gem_probabilities,
                       ("split", "beta", "base", "frontier_size"), batch_native=False, resolution="min",
                       privacy="split",
                       description="RR(ε₁) on sign of Spearman(q, Δ) picks mGEM or GEM at ε₂"),
}

NONPRIVATE_REFERENCES: dict[str, Mechanism] = {
    "rnmh-nonprivate": _m("rnmh-nonprivate", baselines.rnmh_nonprivate, baselines.rnmh_nonprivate_probabilities,
                          privacy="not-private", resolution=None,
                          description="NOT DP: report-noisy-max with per-candidate noise 2Δ_a/ε"),
}


def get_mechanism(name: str, allow_nonprivate: bool = False) -> Mechanism:
    """Looks a mechanism up; non-private references need allow_nonprivate=True."""
    if name in PRIVATE_MECHANISMS:
        return PRIVATE_MECHANISMS[name]
    if name in NONPRIVATE_REFERENCES:
        if not allow_nonprivate:
            raise ValueError(f"mechanism {name!r} is not differentially private; pass allow_nonprivate=True "
                             "to use it as a reference")
        return NONPRIVATE_REFERENCES[name]
    raise ValueError(f"unknown mechanism {name!r}; private mechanisms: {sorted(PRIVATE_MECHANISMS)}")


def probabilities(name: str, scores, sensitivities, epsilon: float, allow_nonprivate: bool = False,
                  **params) -> np.ndarray:
    """Exact output probabilities [..., k] (float64) of mechanism `name`."""
    return get_mechanism(name, allow_nonprivate).probabilities(scores, sensitivities, epsilon, **params)


def privacy_report(name: str, epsilon: float, count: int = 1, delta: float = 1e-6, unit: str = "user",
                   relation: Relation | str = ADD_OR_REMOVE_ONE, **params) -> PrivacyReport:
    """PrivacyReport with `count` selections of mechanism `name` at ε each, under the neighbouring relation
    for which the scores move by at most their sensitivities (add/remove one unit by default). Each release
    is the mechanism's `dp_event`, i.e. its float64 bound ε·(1 + LOSS_SLACK) where that applies."""
    mech = get_mechanism(name)
    report = PrivacyReport(delta=delta, unit=unit, relation=relation)
    event = mech.dp_event(epsilon, **params)
    if isinstance(event, dpe.ComposedDpEvent):  # combined GEM: the RR bit and the GEM/mGEM run
        for part, sub in zip(("correlation-sign-rr", "gem-or-mgem"), event.events):
            report.add(f"select:{name}:{part}", sub, count=count)
        return report
    return report.add(f"select:{name}", event, count=count)
