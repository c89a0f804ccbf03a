"""The mechanism registry, batched selection and privacy bookkeeping.

`PRIVATE_MECHANISMS` maps names to ε-DP mechanisms; `NONPRIVATE_REFERENCES` holds RNMH, which is not
DP and can only be reached under its explicit name "rnmh-nonprivate" (never a default).

    idx = select("gem", key, scores[B, k], sensitivities[k] or [B, k], epsilon)   # int32 [B]
    p = probabilities("gem", scores, sensitivities, epsilon)                     # float64 [B, k]
    event = PRIVATE_MECHANISMS["gem"].dp_event(epsilon)                          # dp_accounting

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

from jdp.accounting import PrivacyReport, check_epsilon, pure_dp_event
from jdp.selection import baselines, correlation, rnm
from jdp.selection._checks import check_open_unit, check_scores, check_shapes

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
        """Exact output probabilities [..., k] (float64)."""
        check_scores(scores, sensitivities)
        epsilon = check_epsilon(epsilon)
        return self.exact_probabilities(scores, sensitivities, epsilon, **self.check_params(params))


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
    "krr": _m("krr", baselines.krr, baselines.krr_probabilities,
              description="k-ary randomized response on the exact argmax"),
    "uniform": _m("uniform", baselines.uniform, baselines.uniform_probabilities,
                  description="uniformly random candidate (0-DP reference)"),
    "rs-geometric": _m("rs-geometric", functools.partial(rs_mod.random_stopping, stopping="geometric"),
                       functools.partial(rs_mod.random_stopping_probabilities, stopping="geometric"),
                       ("gamma", "block"), batch_native=False,
                       description="random stopping, K ~ Geometric(γ), heterogeneous Laplace, ε' = ε/3"),
    "rs-tnb": _m("rs-tnb", functools.partial(rs_mod.random_stopping, stopping="tnb"),
                 functools.partial(rs_mod.random_stopping_probabilities, stopping="tnb"),
                 ("gamma", "eta", "block"), batch_native=False,
                 description="random stopping, K ~ TNB(η, γ), heterogeneous Laplace, ε' = ε/(2+η)"),
    "gem": _m("gem", gem_mod.gem, gem_mod.gem_probabilities, _GEM + ("frontier_size",), batch_native=False,
              description="generalised exponential mechanism, t = 2 ln(k/β)/ε"),
    "mgem": _m("mgem", gem_mod.mgem, gem_mod.mgem_probabilities, _GEM + ("frontier_size",), batch_native=False,
               description="modified GEM, t = −2 ln(k/β)/ε"),
    "combined-gem": _m("combined-gem", gem_mod.combined_gem, gem_mod.combined_gem_probabilities,
                       ("split", "beta", "base", "frontier_size"), batch_native=False,
                       description="RR(ε₁) on sign of Spearman(q, Δ) picks mGEM or GEM at ε₂"),
}

NONPRIVATE_REFERENCES: dict[str, Mechanism] = {
    "rnmh-nonprivate": _m("rnmh-nonprivate", baselines.rnmh_nonprivate, baselines.rnmh_nonprivate_probabilities,
                          private=False, description="NOT DP: report-noisy-max with per-candidate noise 2Δ_a/ε"),
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
    """GEM family on a batch: O(k·m) frontier path with an in-pass dense fallback (see `_gem_fast`)."""
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
    (out, overflow, excess), flags = fn(key, scores, sens, jnp.float32(epsilon), **extra)
    _raise_on(flags)
    if bool(excess):  # rare: redo every overflowed row on the host-driven dense path
        rows = np.nonzero(np.asarray(overflow))[0]
        padded = 1 << int(rows.size - 1).bit_length()  # bucket sizes to bound recompilation
        take = np.concatenate([rows, np.full(padded - rows.size, rows[0])])
        dense = _batched(name, False, sens.ndim == 2, tuple(sorted(params.items())))
        sub, _ = dense(jax.random.fold_in(key, 2), scores[take], sens[take] if sens.ndim == 2 else sens,
                       jnp.float32(epsilon))
        out = out.at[rows].set(sub[: rows.size])
    return out


@functools.lru_cache(maxsize=64)
def _rs_batch(frozen: tuple) -> Callable:
    return _checked(functools.partial(rs_mod.random_stopping_batch, **dict(frozen)))


@functools.lru_cache(maxsize=64)
def _rs_poissonized(frozen: tuple) -> Callable:
    return _checked(functools.partial(rs_mod.random_stopping_poissonized, **dict(frozen)))


def select(name: str, key: jax.Array, scores, sensitivities, epsilon: float, allow_nonprivate: bool = False,
           **params) -> jax.Array:
    """Runs mechanism `name` on every row of scores [B, k] (or one problem [k]) -> int32 [B] (or []).

    sensitivities: [k] shared by all rows, or [B, k]. Validates the inputs (finite scores, finite
    positive sensitivities, ε > 0) and jit-compiles once per (name, params, shapes).
    """
    mech = get_mechanism(name, allow_nonprivate)
    params = mech.check_params(params)
    epsilon = check_epsilon(epsilon)
    check_shapes(scores, sensitivities)  # values are checked inside the compiled call (`_checked`)
    scores = jnp.asarray(scores, jnp.float32)
    sens = jnp.asarray(sensitivities, jnp.float32)
    single = scores.ndim == 1
    if single:
        scores, sens = scores[None], sens
    elif scores.ndim != 2:
        raise ValueError(f"scores must have shape [k] or [B, k], got {scores.shape}")
    k = scores.shape[-1]
    if name in _GEM_FAST and k >= 32 and params.get("frontier_size", 0) is not None:
        out = _select_gem(name, key, scores, sens, epsilon, params)
        return out[0] if single else out
    if name.startswith("rs-") and "block" not in params:
        stopping = "tnb" if name == "rs-tnb" else "geometric"
        eta = params.get("eta", 1.0) if stopping == "tnb" else 1.0
        gamma = params.get("gamma") or 1.0 / k
        mean_k = rs_mod.expected_stopping_time(gamma, stopping, eta)
        frozen = tuple(sorted({**params, "stopping": stopping}.items()))
        if eta > 0 and mean_k >= k / 8:  # dense O(k) Poissonized sampler beats O(K) draws
            fn = _rs_poissonized(frozen)
        elif scores.shape[0] * mean_k < 2**26:  # stream of Σ K draws; int32 positions with a wide margin
            fn = _rs_batch(frozen)
        else:
            fn = None
        if fn is not None:
            out, flags = fn(key, scores, jnp.broadcast_to(sens, scores.shape), jnp.float32(epsilon))
            _raise_on(flags)
            return out[0] if single else out
    fn = _batched(name, allow_nonprivate, sens.ndim == 2, tuple(sorted(params.items())))
    out, flags = fn(key, scores, sens, jnp.float32(epsilon))
    _raise_on(flags)  # invalid input: nothing is returned
    return out[0] if single else out


def probabilities(name: str, scores, sensitivities, epsilon: float, allow_nonprivate: bool = False,
                  **params) -> np.ndarray:
    """Exact output probabilities [..., k] (float64) of mechanism `name`."""
    return get_mechanism(name, allow_nonprivate).probabilities(scores, sensitivities, epsilon, **params)


def privacy_report(name: str, epsilon: float, count: int = 1, delta: float = 1e-6, unit: str = "user",
                   relation: str = "add/remove one user's data (scores move by at most their sensitivities)",
                   **params) -> PrivacyReport:
    """PrivacyReport with `count` selections of mechanism `name` at ε each."""
    mech = get_mechanism(name)
    report = PrivacyReport(delta=delta, unit=unit, relation=relation)
    event = mech.dp_event(epsilon, **params)
    if isinstance(event, dpe.ComposedDpEvent):  # combined GEM: the RR bit and the GEM/mGEM run
        for part, sub in zip(("correlation-sign-rr", "gem-or-mgem"), event.events):
            report.add(f"select:{name}:{part}", sub, count=count)
        return report
    return report.add(f"select:{name}", event, count=count)
