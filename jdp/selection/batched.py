"""Running a selection mechanism on a batch of problems: `select`, jit-compiled once per (mechanism, params,
shapes), usable eagerly and inside the caller's `jax.jit` / `jax.vmap`.

    idx = select("gem", key, scores[B, k], sensitivities[k] or [B, k], epsilon)   # int32 [B]

`select` converts scores and sensitivities to float64 (exact for float32/float64 input, numpy or jax),
subtracts each row's maximum in float64 before anything else, and runs every sampler in float64
(`jax.enable_x64` inside the call; under a caller's trace x64 must be on): the realised output law equals
the exact one (`jdp.selection.registry.probabilities`) up to float64 rounding (absolute error ~k·2⁻⁵² per
candidate, where float32 samplers had ~2⁻²³). Fast paths: the GEM family walks a bounded hull frontier and
redoes overflowing rows densely in the same pass; random stopping uses a Poissonized or a streamed sampler.

Privacy of `select` on a batch: each row is one selection at ε. When row i only reads the data of
privacy unit i (e.g. one recommendation per user from that user's scores), rows compose in parallel
and the batch is ε-DP per unit; otherwise the caller composes B events (`privacy_report(count=B)`).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdp.selection import correlation
from jdp.selection import generalized_em as gem_mod
from jdp.selection import random_stop as rs_mod
from jdp.selection.registry import (PRIVATE_MECHANISMS, _gem_shift_magnitude, check_range, get_mechanism,
                                    range_violations, resolution_violations)
from jdp.validation import check_epsilon_target, check_shapes, is_concrete


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
def _shift_rows(scores, sens, t_abs, epsilon, resolution):
    """(scores − row max, range-ok flag) in the input dtype (float64 in `select`); NaN/inf stay non-finite
    for `_checked`'s flags. The flag is `range_violations`' rule: an infinite magnitude from finite inputs (GEM's
    q_a − tΔ_a past float64's range) and a noise scale outside float64's normal range violate it too. Non-finite
    inputs and Δ ≤ 0 are reported by `_checked` first (`finish` raises on its flags before it checks the range)."""
    q = scores - jnp.max(scores, axis=-1, keepdims=True)
    if resolution is None:
        return q, jnp.bool_(True)
    return q, ~jnp.any(resolution_violations(q, sens, t_abs, epsilon, resolution))


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
    epsilon = check_epsilon_target(epsilon)   # > MAX_EPSILON refused (the report could not account it)
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
    scores, range_ok = _shift_rows(scores, sens, _gem_shift_magnitude(mech, k, epsilon, params), epsilon,
                                   mech.resolution)

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


__all__ = ["select"]
