"""Taps on Flax linen layers: find the call sites of recognised layers, record their inputs and get
every per-example output gradient from one backward pass.

How it works (no change to the user's model):
1. `discover` traces the per-example loss once with `flax.linen.intercept_methods`. Every call of a
   recognised layer (Dense, DenseGeneral, Embed and Embed.attend, LayerNorm, RMSNorm) whose parameters
   are leaves of the `params` argument becomes a *site*. At a site the layer is re-applied (a clone of
   the module) with a separate copy of its parameters, so in the traced jaxpr the original parameter
   inputs are only used by code we do NOT recognise. A parameter leaf is *covered* when it is used by
   sites only; every other used leaf goes to the exact vmap fallback. This makes the split safe: a
   parameter read anywhere else (a custom layer, a lifted `nn.scan`, a regulariser in the loss) can
   never be silently missed.
2. `run_per_example` evaluates the loss for ONE example (a batch of size 1; the caller vmaps it) and
   differentiates it w.r.t. zero taps added to each site's output and w.r.t. the fallback leaves. The
   tap gradients are the per-example output gradients; the recorded inputs are the activations.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import flax.linen as nn
from flax.core import tracers as _flax_tracers
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

# Recognised (module type, method) -> site kind.
_KINDS: dict[tuple[type, str], str] = {
    (nn.Dense, "__call__"): "dense",
    (nn.DenseGeneral, "__call__"): "dense",
    (nn.Embed, "__call__"): "lookup",
    (nn.Embed, "attend"): "attend",
    (nn.LayerNorm, "__call__"): "local",
    (nn.RMSNorm, "__call__"): "local",
}


@dataclasses.dataclass(frozen=True)
class Site:
    """One recognised call of a layer (static description, per-example shapes incl. the leading 1)."""
    index: int
    kind: str                       # dense | lookup | attend | local
    module: Any                     # unbound clone of the module (config only)
    method: str
    param_names: tuple[str, ...]    # the module's own parameter names
    leaf_ids: tuple[int, ...]       # index of each parameter in the flattened params
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    out_dtype: Any
    axis: tuple[int, ...] = ()      # dense: contracted input axes (normalised)


class _State(threading.local):
    def __init__(self):
        self.active = None


_STATE = _State()


class _Tapper:
    """Interceptor state for one trace ('discover' or 'run')."""

    def __init__(self, mode: str, leaves: Sequence[Any], site_leaves: Sequence[Any],
                 sites: Sequence[Site] | None = None, allowed: frozenset[int] = frozenset(),
                 taps: Sequence[Any] | None = None):
        self.mode = mode
        self.leaf_index = {id(x): i for i, x in enumerate(leaves)}
        self.site_leaves = site_leaves
        self.sites = list(sites) if sites is not None else []
        self.allowed = allowed
        self.taps = taps
        self.records: dict[int, Any] = {}
        self.count = 0
        self.bypass = False
        # Calls made under a (lifted) transformation inside the loss (nn.scan, nn.remat, jax.lax.map...)
        # run at another trace level: they are not tapped (their inputs could not be recorded).
        self.trace = _flax_tracers.current_trace()

    def _candidate(self, mod, method, args, kwargs):
        kind = _KINDS.get((type(mod), method))
        if kind is None or kwargs or len(args) != 1 or mod.scope is None:
            return None
        if _flax_tracers.current_trace() != self.trace:
            return None
        if kind == "dense" and isinstance(mod, nn.DenseGeneral) and mod.batch_dims:
            return None
        own = mod.variables.get("params", None)
        if not own:
            return None
        names, ids = [], []
        for name, value in own.items():
            if not isinstance(value, jax.Array) and not hasattr(value, "shape"):
                return None  # nested dict: the module has children; not a leaf layer
            idx = self.leaf_index.get(id(value))
            if idx is None:
                return None  # parameters not passed in directly (lifted transform, cast, ...)
            names.append(name)
            ids.append(idx)
        return kind, tuple(names), tuple(ids)

    def _apply_clone(self, site_mod, names, ids, method, x):
        own = {n: self.site_leaves[i] for n, i in zip(names, ids)}
        self.bypass = True
        try:
            return site_mod.apply({"params": own}, x, method=method)
        finally:
            self.bypass = False

    def __call__(self, next_fun, args, kwargs, context):
        if self.bypass:
            return next_fun(*args, **kwargs)
        mod, method = context.module, context.method_name
        cand = self._candidate(mod, method, args, kwargs)
        if cand is None:
            return next_fun(*args, **kwargs)
        kind, names, ids = cand
        k = self.count
        self.count += 1
        x = args[0]
        if self.mode == "discover":
            clone = mod.clone(parent=None)
            out = self._apply_clone(clone, names, ids, method, x)
            axis = ()
            if kind == "dense":
                ax = mod.axis if isinstance(mod, nn.DenseGeneral) else -1
                ax = (ax,) if isinstance(ax, int) else tuple(ax)
                axis = tuple(sorted(a % x.ndim for a in ax))
            self.sites.append(Site(k, kind, clone, method, names, ids, tuple(x.shape),
                                   tuple(out.shape), out.dtype, axis))
            return out
        # run mode
        site = self.sites[k]
        if site.kind != kind or site.param_names != names:
            raise RuntimeError("the model's layer calls changed between traces; the loss must be a "
                               "deterministic function of (params, batch)")
        if k not in self.allowed:
            return next_fun(*args, **kwargs)
        out = self._apply_clone(site.module, names, ids, method, x)
        self.records[k] = x
        return out + self.taps[k].astype(out.dtype)


def _used_invars(closed_jaxpr) -> set:
    jaxpr = closed_jaxpr.jaxpr
    used = set()
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jex_core.Var):
                used.add(v)
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Var):
            used.add(v)
    return used


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which sites are tapped and which parameter leaves are covered / fallback / unused."""
    sites: tuple[Site, ...]
    allowed: frozenset[int]
    covered: frozenset[int]
    fallback: tuple[int, ...]
    loss_shape: tuple[int, ...]


def discover(per_example_loss: Callable, leaves: Sequence[Any], treedef, example: Any,
             use_taps: bool = True) -> Plan:
    """Traces the per-example loss abstractly and returns the tapping plan.

    per_example_loss(params, example_with_leading_1) -> losses [1]. `leaves`, `example`: arrays or
    ShapeDtypeStructs (only shapes/dtypes are used).
    """
    leaf_structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]
    ex_structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), example)
    holder: dict[str, Any] = {}

    def fn(lv, site_lv, ex):
        params = jax.tree.unflatten(treedef, lv)
        tapper = _Tapper("discover", lv, site_lv)
        if use_taps:
            with nn.intercept_methods(tapper):
                loss = per_example_loss(params, ex)
        else:
            loss = per_example_loss(params, ex)
        holder["tapper"] = tapper
        holder["loss_shape"] = tuple(jnp.shape(loss))
        return loss

    closed = jax.make_jaxpr(fn)(leaf_structs, leaf_structs, ex_structs)
    tapper = holder["tapper"]
    n = len(leaves)
    used = _used_invars(closed)
    invars = closed.jaxpr.invars
    direct = {i for i in range(n) if invars[i] in used}          # original leaf used outside sites
    via_site = {i for i in range(n) if invars[n + i] in used}     # leaf used by a site
    sites = tuple(tapper.sites)
    # A module whose parameters are also used elsewhere is not tapped at all (all its leaves fall back).
    allowed = frozenset(s.index for s in sites if not (set(s.leaf_ids) & direct))
    covered = set()
    for s in sites:
        if s.index in allowed:
            covered.update(s.leaf_ids)
    fallback = tuple(sorted((direct | via_site) - covered))
    return Plan(sites, allowed, frozenset(covered), fallback, holder["loss_shape"])


def run_per_example(per_example_loss: Callable, plan: Plan, leaves: Sequence[Any], treedef,
                    example: Any):
    """Loss of one example and its gradients w.r.t. the site outputs and the fallback leaves.

    Returns (loss [], records {site: input}, tap_grads {site: output grad}, fallback_grads list).
    Must be called under jax.vmap over examples (example has a leading axis of size 1 inside).
    """
    fb = list(plan.fallback)
    taps = {k: jnp.zeros(plan.sites[k].out_shape, plan.sites[k].out_dtype) for k in plan.allowed}

    def f(fb_leaves, taps):
        lv = list(leaves)
        for i, x in zip(fb, fb_leaves):
            lv[i] = x
        params = jax.tree.unflatten(treedef, lv)
        tapper = _Tapper("run", lv, lv, plan.sites, plan.allowed, taps)
        if plan.allowed:
            with nn.intercept_methods(tapper):
                loss = per_example_loss(params, example)
        else:
            loss = per_example_loss(params, example)
        if tapper.count != len(plan.sites) and plan.allowed:
            raise RuntimeError("the model's layer calls changed between traces")
        return jnp.reshape(loss, ()), tapper.records

    (loss, records), (g_fb, g_taps) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        [leaves[i] for i in fb], taps)
    return loss, records, g_taps, g_fb
