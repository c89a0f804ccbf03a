"""The mechanism registry, batched selection and privacy bookkeeping.

`PRIVATE_MECHANISMS` maps names to ε-DP mechanisms; `NONPRIVATE_REFERENCES` holds RNMH, which is not
DP and can only be reached under its explicit name "rnmh-nonprivate" (never a default).

    idx = select("gem", key, scores[B, k], sensitivities[k] or [B, k], epsilon)   # int32 [B]
    p = probabilities("gem", scores, sensitivities, epsilon)                     # float64 [B, k]
    event = PRIVATE_MECHANISMS["gem"].dp_event(epsilon)                          # dp_accounting

Numerics (offset invariance, exactness): every mechanism's output law depends on the scores only
through their differences within a row (noisy max, EM, PF and RS_γ compare q_a + noise across a row;
kRR uses the argmax; GEM's s_a uses q_a − q_b; combined GEM's Spearman bit uses ranks), so subtracting
each row's maximum leaves every law unchanged. `select` converts scores and sensitivities to float64
(exact for float32/float64 input, numpy or jax), subtracts each row's maximum in float64 before
anything else, and runs every sampler in float64 (`jax.enable_x64` inside the call): the realised
output law equals the exact one up to float64 rounding (absolute error ~k·2⁻⁵² per candidate, where
float32 samplers had ~2⁻²³). Rows whose range is too large for float64 relative to the sensitivities
are rejected (`check_range`). `probabilities` applies the same shift and check on the host.
`select` needs concrete arrays; inside your own `jax.jit` call the per-problem function
`get_mechanism(name).sample`, which computes in the dtype it is given: subtract each row's maximum
yourself first and pass float64 under `jax.enable_x64` for the same exactness (it does neither).

Privacy of `select` on a batch: each row is one selection at ε. When row i only reads the data of
privacy unit i (e.g. one recommendation per user from that user's scores), rows compose in parallel
and the batch is ε-DP per unit; otherwise the caller composes B events (`privacy_report(count=B)`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import dp_event as dpe

from jdp.accounting import ADD_OR_REMOVE_ONE, PrivacyReport, Relation, pure_dp_event
from jdp.validation import check_epsilon
from jdp.selection import baselines, correlation, rnm
from jdp.validation import check_open_unit, check_scores, check_shapes, is_concrete

from jdp.selection import generalized_em as gem_mod
from jdp.selection import random_stop as rs_mod


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
    private: bool = True
    batch_native: bool = True
    description: str = ""
    # what the float64 rounding of the shifted scores is compared with (see `check_range`): "max" for the
    # homogeneous mechanisms (calibrated to Δ = max Δ_a), "min" for the per-candidate ones (GEM family,
    # RS_γ), None where any function of the scores is private (kRR, uniform) or nothing is promised (RNMH)
    resolution: str | None = "max"

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

    def dp_event(self, epsilon: float, **params) -> dpe.DpEvent:
        """The dp_accounting event of one selection at total budget ε (pure ε-DP)."""
        if not self.private:
            raise ValueError(f"{self.name!r} is NOT differentially private: it has no dp_event")
        epsilon = check_epsilon(epsilon)
        params = self.check_params(params)
        if self.name == "uniform":
            return dpe.NoOpDpEvent()
        if self.name == "combined-gem":
            split = params.get("split", 0.5)
            return dpe.ComposedDpEvent([pure_dp_event(split * epsilon), pure_dp_event((1 - split) * epsilon)])
        return pure_dp_event(epsilon)

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
_UNIT_ROUNDOFF = 2.0 ** -53
_LOSS_SLACK = 2.0 ** -12


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
    (`_UNIT_ROUNDOFF`·magnitude > `_LOSS_SLACK`/4 · Δ). `shifted`: scores minus their row maximum
    (numpy or jax arrays; jax inside `select`'s float64 pass)."""
    xp = np if isinstance(shifted, np.ndarray) else jnp
    d = xp.broadcast_to(sensitivities, shifted.shape)
    ref = xp.max(d, axis=-1) if mech.resolution == "max" else xp.min(d, axis=-1)
    t = _gem_shift_magnitude(mech, shifted.shape[-1], epsilon, params)
    magnitude = -xp.min(shifted, axis=-1) + t * xp.max(d, axis=-1)
    return 4.0 * _UNIT_ROUNDOFF * magnitude > _LOSS_SLACK * ref


def check_range(mech: Mechanism, shifted, sensitivities, epsilon: float, params: dict) -> None:
    """ValueError naming `scores` when some row's range cannot be resolved (see `range_violations`)."""
    if mech.resolution is None:
        return
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
    "uniform": _m("uniform", baselines.uniform, baselines.uniform_probabilities, resolution=None,
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
                       description="RR(ε₁) on sign of Spearman(q, Δ) picks mGEM or GEM at ε₂"),
}

NONPRIVATE_REFERENCES: dict[str, Mechanism] = {
    "rnmh-nonprivate": _m("rnmh-nonprivate", baselines.rnmh_nonprivate, baselines.rnmh_nonprivate_probabilities,
                          private=False, resolution=None, description="NOT DP: report-noisy-max with per-candidate noise 2Δ_a/ε"),
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


def _checked(fn: Callable) -> Callable:
    """jit(fn) that also returns input-validity flags, computed in the same compiled pass (cheaper than
    a separate host scan); `select` raises on them before anything is returned."""
    def run(key, scores, sens, epsilon, **extra):
        flags = jnp.stack([jnp.all(jnp.isfinite(scores)), jnp.all(jnp.isfinite(sens)), jnp.all(sens > 0)])
        return fn(key, scores, sens, epsilon, **extra), flags
    return jax.jit(run)


def _raise_on(flags) -> None:
    finite_q, finite_d, positive_d = (bool(f) for f in np.asarray(flags))
    if not finite_q:
        raise ValueError("scores must be finite (no NaN/inf)")
    if not finite_d:
        raise ValueError("sensitivities must be finite (no NaN/inf)")
    if not positive_d:
        raise ValueError("sensitivities must be > 0 (use a small public floor for constant scores)")


@functools.lru_cache(maxsize=256)
def _batched(name: str, allow_nonprivate: bool, sens_batched: bool, frozen: tuple) -> Callable:
    mech = get_mechanism(name, allow_nonprivate)
    fn = functools.partial(mech.sample, **dict(frozen))
    if mech.batch_native:
        return _checked(fn)

    def run(key, scores, sens, epsilon):
        keys = jax.random.split(key, scores.shape[0])
        return jax.vmap(fn, in_axes=(0, 0, 0 if sens_batched else None, None))(keys, scores, sens, epsilon)

    return _checked(run)


_GEM_FAST = {
    "gem": functools.partial(gem_mod.gem_fast, negative=False),
    "mgem": functools.partial(gem_mod.gem_fast, negative=True),
    "combined-gem": gem_mod.combined_gem_fast,
}


def _frontier_default(k: int) -> int:
    """Cap on the hull walk: chains grow like ln k; measured fastest caps for random instances (a few
    rows overflow to the dense path at k = 100 with 8; at k = 1,000, 16 avoids almost all of them)."""
    return 8 if k <= 128 else 16


@functools.lru_cache(maxsize=64)
def _gem_fast(name: str, frozen: tuple, capacity: int, sens_batched: bool) -> Callable:
    """One compiled pass: the frontier path on every row, then the rows whose hull chain overflowed
    (up to `capacity` of them) recomputed densely with fresh randomness, so every row has exactly the
    mechanism's output distribution. Returns ((out, overflow, excess), flags); `excess`: more than
    `capacity` rows overflowed and the caller must redo them."""
    params = dict(frozen)
    fast = functools.partial(_GEM_FAST[name], **params)
    dense = functools.partial(PRIVATE_MECHANISMS[name].sample, **{**params, "frontier_size": None})

    def run(key, scores, sens, epsilon, **extra):
        out, overflow = fast(key, scores, sens, epsilon, **extra)
        rows = jnp.nonzero(overflow, size=capacity, fill_value=scores.shape[0])[0]  # fill: out of range
        q_rows = scores.at[rows].get(mode="fill", fill_value=0.0)
        d_rows = sens.at[rows].get(mode="fill", fill_value=1.0) if sens_batched else sens
        keys = jax.random.split(jax.random.fold_in(key, 1), capacity)
        row_extra = {arg: v.at[rows].get(mode="fill", fill_value=False) for arg, v in extra.items()}
        redo = jax.vmap(lambda k, q, d, e: dense(k, q, d, epsilon, **e), in_axes=(0, 0, 0 if sens_batched else None, 0))
        out = jax.lax.cond(jnp.any(overflow),  # skip the dense work when every chain fitted
                           lambda: out.at[rows].set(redo(keys, q_rows, d_rows, row_extra), mode="drop"), lambda: out)
        return out, overflow, jnp.sum(overflow) > capacity

    return _checked(run)


def _select_gem(name, key, scores, sens, epsilon, params):
    """GEM family on a batch: O(k·m) frontier path with an in-pass dense fallback (see `_gem_fast`);
    returns (out, validity flags)."""
    params = dict(params)
    k = scores.shape[-1]
    m = params.pop("frontier_size", None) or _frontier_default(k)
    extra = {}
    if name == "combined-gem" and all(dev.platform == "cpu" for dev in scores.devices()):
        # the Spearman bit needs two sorts per row; XLA:CPU's sort is ~20x slower than NumPy's
        extra["positive"] = jnp.asarray(correlation.spearman_positive_np(np.asarray(scores), np.asarray(sens)))
    batch = scores.shape[0]
    # rows redone densely in the pass (O(k²) each): ~1.5% of rows at k ≤ 128, fewer for larger k
    capacity = min(batch, max(8, 2 * batch // max(k, 128)))
    fn = _gem_fast(name, tuple(sorted(params.items())) + (("frontier_size", m),), capacity, sens.ndim == 2)
    (out, overflow, excess), flags = fn(key, scores, sens, epsilon, **extra)
    if bool(excess) and bool(np.all(np.asarray(flags))):  # rare: redo every overflowed row on the host-driven dense path
        rows = np.nonzero(np.asarray(overflow))[0]
        padded = 1 << int(rows.size - 1).bit_length()  # bucket sizes to bound recompilation
        take = np.concatenate([rows, np.full(padded - rows.size, rows[0])])
        dense = _batched(name, False, sens.ndim == 2, tuple(sorted(params.items())))
        sub, _ = dense(jax.random.fold_in(key, 2), scores[take], sens[take] if sens.ndim == 2 else sens,
                       epsilon)
        out = out.at[rows].set(sub[: rows.size])
    return out, flags


@functools.lru_cache(maxsize=64)
def _rs_batch(frozen: tuple) -> Callable:
    return _checked(functools.partial(rs_mod.random_stopping_batch, **dict(frozen)))


@functools.lru_cache(maxsize=64)
def _rs_poissonized(frozen: tuple) -> Callable:
    return _checked(functools.partial(rs_mod.random_stopping_poissonized, **dict(frozen)))


@functools.partial(jax.jit, static_argnames=("resolution",))
def _shift_rows(scores, sens, t_abs, resolution):
    """(scores − row max, range-ok flag) in the input dtype (float64 in `select`); NaN/inf stay non-finite
    for `_checked`'s flags."""
    q = scores - jnp.max(scores, axis=-1, keepdims=True)
    if resolution is None:
        return q, jnp.bool_(True)
    d = jnp.broadcast_to(sens, q.shape)
    ref = jnp.max(d, axis=-1) if resolution == "max" else jnp.min(d, axis=-1)
    magnitude = -jnp.min(q, axis=-1) + t_abs * jnp.max(d, axis=-1)
    bad = 4.0 * _UNIT_ROUNDOFF * magnitude > _LOSS_SLACK * ref
    return q, ~jnp.any(bad & jnp.isfinite(magnitude) & (ref > 0))  # non-finite / Δ ≤ 0: reported by `_checked`


def select(name: str, key: jax.Array, scores, sensitivities, epsilon: float, allow_nonprivate: bool = False,
           **params) -> jax.Array:
    """Runs mechanism `name` on every row of scores [B, k] (or one problem [k]) -> int32 [B] (or []).

    sensitivities: [k] shared by all rows, or [B, k]. Validates the inputs (finite scores, finite
    positive sensitivities, ε > 0, each row's range resolvable: `check_range`) and jit-compiles once per
    (name, params, shapes). Scores and sensitivities (numpy or jax, any float dtype) are converted to
    float64, each row's maximum is subtracted in float64 before anything else (outputs are invariant to
    a common offset per row) and the sampler runs in float64 (see the module docstring).

    Composes with `jax.jit` / `jax.vmap`: with traced scores, sensitivities or key the same sampler
    runs inside the caller's trace. It still samples in float64, so x64 must be on for that trace
    (`jax.config.update("jax_enable_x64", True)`, or `with jax.enable_x64(True):` around the call);
    ε and params stay Python values (public). Values cannot be checked on the host there: a row with
    non-finite scores, non-positive or non-finite sensitivities or an unresolvable range returns -1.
    """
    mech = get_mechanism(name, allow_nonprivate)
    params = mech.check_params(params)
    if isinstance(epsilon, jax.core.Tracer):
        raise ValueError("epsilon must be a concrete number (a public parameter), not a traced value")
    epsilon = check_epsilon(epsilon)
    check_shapes(scores, sensitivities)  # values are checked inside the compiled call (`_checked`)
    if not is_concrete(scores, sensitivities, key):
        return _select_traced(mech, name, key, scores, sensitivities, epsilon, allow_nonprivate, params)
    with jax.enable_x64(True):
        return _select64(mech, name, key, scores, sensitivities, epsilon, allow_nonprivate, params)


def _select_traced(mech, name, key, scores, sensitivities, epsilon, allow_nonprivate, params):
    """`select` inside a jit/vmap trace: the same samplers, validity per row in the graph (-1 if invalid)."""
    if jnp.asarray(0.0).dtype != jnp.float64:
        raise ValueError(f"select({name!r}) under jax.jit/vmap samples in float64 like its eager form: enable x64 "
                         "for the traced call (jax.config.update('jax_enable_x64', True), or `with "
                         "jax.enable_x64(True):` around it); a float32 sampler would change the mechanism's "
                         "output probabilities")
    scores, sens = jnp.asarray(scores, jnp.float64), jnp.asarray(sensitivities, jnp.float64)
    single = scores.ndim == 1
    if single:
        scores = scores[None]
    elif scores.ndim != 2:
        raise ValueError(f"scores must have shape [k] or [B, k], got {scores.shape}")
    k = scores.shape[-1]
    shifted = scores - jnp.max(scores, axis=-1, keepdims=True)
    d = jnp.broadcast_to(sens, scores.shape)
    row_ok = (jnp.all(jnp.isfinite(scores), -1) & jnp.all(jnp.isfinite(d), -1) & jnp.all(d > 0, -1))
    if mech.resolution is not None:
        row_ok &= ~range_violations(mech, shifted, sens, epsilon, params)
    frozen = tuple(sorted(params.items()))
    eps = jnp.float64(epsilon)
    if name in _GEM_FAST and k >= 32 and params.get("frontier_size", 0) is not None:
        # capacity = every row: any overflowed hull chain is redone densely inside the same pass
        m = params.get("frontier_size") or _frontier_default(k)
        frozen = tuple(sorted({**params, "frontier_size": m}.items()))
        (out, _, _), _ = _gem_fast(name, frozen, scores.shape[0], sens.ndim == 2)(key, shifted, sens, eps)
    elif (rs := _rs_sampler(name, params, scores.shape)) is not None:
        out, _ = rs(key, shifted, d, eps)
    else:
        out, _ = _batched(name, allow_nonprivate, sens.ndim == 2, frozen)(key, shifted, sens, eps)
    out = jnp.where(row_ok, out, -1)
    return out[0] if single else out


def _select64(mech, name, key, scores, sensitivities, epsilon, allow_nonprivate, params):
    scores = jnp.asarray(scores, jnp.float64)  # exact for float32 / float64 inputs
    sens = jnp.asarray(sensitivities, jnp.float64)
    single = scores.ndim == 1
    if single:
        scores, sens = scores[None], sens
    elif scores.ndim != 2:
        raise ValueError(f"scores must have shape [k] or [B, k], got {scores.shape}")
    k = scores.shape[-1]
    scores, range_ok = _shift_rows(scores, sens, _gem_shift_magnitude(mech, k, epsilon, params), mech.resolution)

    def finish(out, flags):
        _raise_on(flags)  # invalid input: nothing is returned
        if not bool(range_ok):
            check_range(mech, np.asarray(scores), np.asarray(sens), epsilon, params)
        return out[0] if single else out

    eps = jnp.float64(epsilon)
    if name in _GEM_FAST and k >= 32 and params.get("frontier_size", 0) is not None:
        return finish(*_select_gem(name, key, scores, sens, eps, params))
    fn = _rs_sampler(name, params, scores.shape)
    if fn is not None:
        return finish(*fn(key, scores, jnp.broadcast_to(sens, scores.shape), eps))
    fn = _batched(name, allow_nonprivate, sens.ndim == 2, tuple(sorted(params.items())))
    return finish(*fn(key, scores, sens, eps))


def _rs_sampler(name: str, params: dict, shape: tuple[int, int]) -> Callable | None:
    """The batched random-stopping sampler for this size (None: the generic per-row one)."""
    if not name.startswith("rs-") or "block" in params:
        return None
    batch, k = shape
    stopping = "tnb" if name == "rs-tnb" else "geometric"
    eta = params.get("eta", 1.0) if stopping == "tnb" else 1.0
    gamma = params.get("gamma") or 1.0 / k
    mean_k = rs_mod.expected_stopping_time(gamma, stopping, eta)
    frozen = tuple(sorted({**params, "stopping": stopping}.items()))
    if eta > 0 and mean_k >= k / 8:  # dense O(k) Poissonized sampler beats O(K) draws
        return _rs_poissonized(frozen)
    if batch * mean_k < 2**26:  # stream of Σ K draws; int32 positions with a wide margin
        return _rs_batch(frozen)
    return None


def probabilities(name: str, scores, sensitivities, epsilon: float, allow_nonprivate: bool = False,
                  **params) -> np.ndarray:
    """Exact output probabilities [..., k] (float64) of mechanism `name`."""
    return get_mechanism(name, allow_nonprivate).probabilities(scores, sensitivities, epsilon, **params)


def privacy_report(name: str, epsilon: float, count: int = 1, delta: float = 1e-6, unit: str = "user",
                   relation: Relation | str = ADD_OR_REMOVE_ONE, **params) -> PrivacyReport:
    """PrivacyReport with `count` selections of mechanism `name` at ε each, under the neighbouring relation
    for which the scores move by at most their sensitivities (add/remove one unit by default)."""
    mech = get_mechanism(name)
    report = PrivacyReport(delta=delta, unit=unit, relation=relation)
    event = mech.dp_event(epsilon, **params)
    if isinstance(event, dpe.ComposedDpEvent):  # combined GEM: the RR bit and the GEM/mGEM run
        for part, sub in zip(("correlation-sign-rr", "gem-or-mgem"), event.events):
            report.add(f"select:{name}:{part}", sub, count=count)
        return report
    return report.add(f"select:{name}", event, count=count)
