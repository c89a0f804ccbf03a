"""Taps on Flax layers (linen and nnx): find the call sites of recognised layers, record their inputs and
get every per-example output gradient from one backward pass.

How it works (no change to the user's model):
1. `discover` traces the per-example loss once, intercepting layer calls (linen: flax's
   `intercept_methods`; nnx, which has no interceptor: the recognised layers' methods are wrapped on
   their classes for the duration of the trace). Every call of a recognised layer (Dense/Linear,
   DenseGeneral, Conv, Embed and Embed.attend, Layer/RMS/Group/InstanceNorm) whose parameters are
   leaves of the `params` argument becomes a *site*. At a site the layer is re-applied with a separate
   copy of its parameters, so in the traced jaxpr the original parameter inputs are only used by code
   we do NOT recognise. A parameter leaf is *covered* when it is used by sites only; every other used
   leaf goes to the exact vmap fallback. This makes the split safe: a parameter read anywhere else (a
   custom layer, a lifted `nn.scan`, a regulariser in the loss) can never be silently missed.
   The same trace checks that per-example evaluation keeps the model's meaning: BatchNorm in training
   mode is refused, and random draws whose key does not depend on the example are reported
   (`SharedRandomnessWarning`).
2. `run_per_example` evaluates the loss for ONE example (a batch of size 1; the caller vmaps it) and
   differentiates it w.r.t. zero taps added to each site's output and w.r.t. the fallback leaves. The
   tap gradients are the per-example output gradients; the recorded inputs are the activations.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
from flax import nnx
from flax.core import tracers as _flax_tracers
from flax.linen.linear import canonicalize_padding
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

# Recognised (module type, method) -> site kind.
_KINDS: dict[tuple[type, str], str] = {
    (nn.Dense, "__call__"): "dense",
    (nn.DenseGeneral, "__call__"): "dense",
    (nn.Conv, "__call__"): "conv",
    (nn.Embed, "__call__"): "lookup",
    (nn.Embed, "attend"): "attend",
    (nn.LayerNorm, "__call__"): "local",
    (nn.RMSNorm, "__call__"): "local",
    (nn.GroupNorm, "__call__"): "local",
    (nn.InstanceNorm, "__call__"): "local",
}
# The same layers in flax.nnx (same parameter names and layouts as their linen twins).
_NNX_KINDS: dict[tuple[type, str], str] = {
    (nnx.Linear, "__call__"): "dense",
    (nnx.Conv, "__call__"): "conv",
    (nnx.Embed, "__call__"): "lookup",
    (nnx.Embed, "attend"): "attend",
    (nnx.LayerNorm, "__call__"): "local",
    (nnx.RMSNorm, "__call__"): "local",
    (nnx.GroupNorm, "__call__"): "local",
}


@dataclasses.dataclass(frozen=True)
class Site:
    """One recognised call of a layer (static description, per-example shapes incl. the leading 1)."""
    index: int
    kind: str                       # dense | conv | lookup | attend | local
    layer: str                      # the layer's class name
    method: str
    apply: Callable                 # apply(own_params: {name: array}, x) -> the layer's output
    param_names: tuple[str, ...]    # the layer's own parameter names
    leaf_ids: tuple[int, ...]       # index of each parameter in the flattened params
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    out_dtype: Any
    axis: tuple[int, ...] = ()      # dense: contracted input axes (normalised)
    conv: Any = None                # conv: an nn.Conv with the layer's configuration


@dataclasses.dataclass(frozen=True)
class _Candidate:
    kind: str
    names: tuple[str, ...]
    ids: tuple[int, ...]
    apply: Callable
    axis: tuple[int, ...] = ()
    conv: Any = None


class _State(threading.local):
    def __init__(self):
        self.active = None


_STATE = _State()


def _tuple(v, n: int) -> tuple[int, ...]:
    return (1,) * n if v is None else ((v,) * n if isinstance(v, int) else tuple(v))


class _ConvGeometry(NamedTuple):
    ks: tuple[int, ...]          # kernel spatial size
    strides: tuple[int, ...]
    dil: tuple[int, ...]         # kernel dilation
    pads: list                   # (lo, hi) per spatial axis, as `lax.conv_general_dilated` pads
    out: list[int]               # output positions per spatial axis


def _strided_geometry(conv: nn.Conv, x_shape: tuple[int, ...]) -> _ConvGeometry | None:
    """Where `conv` reads its input, for SAME / VALID / explicit padding without input dilation (its patches
    are strided slices of the zero-padded input); None for every other case."""
    ks = (conv.kernel_size,) if isinstance(conv.kernel_size, int) else tuple(conv.kernel_size)
    nd = len(ks)
    padding = canonicalize_padding(conv.padding, nd)
    if _tuple(conv.input_dilation, nd) != (1,) * nd or (
            isinstance(padding, str) and padding not in ("SAME", "VALID", "SAME_LOWER")):
        return None
    strides, dil = _tuple(conv.strides, nd), _tuple(conv.kernel_dilation, nd)
    spatial = x_shape[-(nd + 1):-1]
    pads = (jax.lax.padtype_to_pads(spatial, [(k - 1) * d + 1 for k, d in zip(ks, dil)], strides, padding)
            if isinstance(padding, str) else [tuple(p) for p in padding])
    out = [(n + lo + hi - (k - 1) * d - 1) // s + 1 for n, (lo, hi), k, d, s in zip(spatial, pads, ks, dil, strides)]
    return _ConvGeometry(ks, strides, dil, pads, out)


def conv_patches(conv: nn.Conv, x: jax.Array) -> jax.Array:
    """Input patches that each output position of `conv` reads: [..., out positions..., K*C_in], with
    the K*C_in features in the kernel's own (kernel spatial..., C_in) order (im2col).

    SAME / VALID / explicit padding without input dilation: strided slices of the padded input (pads
    from `lax.padtype_to_pads`, as `lax.conv_general_dilated` computes them). Every other case (CIRCULAR,
    REFLECT, CAUSAL, input dilation) is computed by the layer itself — a clone with a one-hot depthwise
    kernel, exact at HIGHEST precision — so its padding semantics are the layer's own."""
    geo = _strided_geometry(conv, x.shape)
    if geo is None:
        return patches_by_layer(conv, x)
    nd, cin = len(geo.ks), x.shape[-1]
    lead = x.shape[:-(nd + 1)]
    xs = x.reshape((-1,) + x.shape[-(nd + 1):])
    if conv.dtype is not None:      # the layer computes in its dtype (as promote_dtype casts)
        xs = xs.astype(conv.dtype)
    xs = jnp.pad(xs, [(0, 0)] + [tuple(p) for p in geo.pads] + [(0, 0)])
    cols = []
    for offset in np.ndindex(*geo.ks):       # row-major over the kernel, as the kernel is laid out
        idx = tuple(slice(o * d, o * d + (m - 1) * s + 1, s)
                    for o, d, m, s in zip(offset, geo.dil, geo.out, geo.strides))
        cols.append(xs[(slice(None),) + idx + (slice(None),)])
    return jnp.concatenate(cols, axis=-1).reshape(lead + tuple(geo.out) + (math.prod(geo.ks) * cin,))


def conv_read_mask(conv: nn.Conv, x_shape: tuple[int, ...]) -> np.ndarray | None:
    """Boolean mask broadcastable to an input of `x_shape`: True at the input positions some output position
    of `conv` reads (strides or a VALID crop can leave some unread). None where `conv_patches` is computed by
    the layer itself (other padding modes, input dilation)."""
    geo = _strided_geometry(conv, x_shape)
    if geo is None:
        return None
    nd = len(geo.ks)
    n_lead, spatial = len(x_shape) - nd - 1, x_shape[-(nd + 1):-1]
    mask = np.ones((1,) * n_lead + tuple(spatial) + (1,), bool)
    for axis, (n, (lo, _), k, d, s, m) in enumerate(zip(spatial, geo.pads, geo.ks, geo.dil, geo.strides, geo.out)):
        pos = (np.arange(m)[:, None] * s + np.arange(k)[None, :] * d - lo).ravel()   # padded -> input index
        read = np.zeros(n, bool)
        read[pos[(pos >= 0) & (pos < n)]] = True
        shape = [1] * mask.ndim
        shape[n_lead + axis] = n
        mask = mask & read.reshape(shape)
    return mask


def patches_by_layer(conv: nn.Conv, x: jax.Array) -> jax.Array:
    """`conv_patches` computed by the layer itself (any padding mode): a one-hot depthwise clone."""
    ks = (conv.kernel_size,) if isinstance(conv.kernel_size, int) else tuple(conv.kernel_size)
    K, cin = math.prod(ks), x.shape[-1]
    # output feature c*K + s of the depthwise clone copies input channel c at kernel offset s
    one_hot = np.tile(np.eye(K, dtype=np.float32).reshape(ks + (1, K)), (1,) * len(ks) + (1, cin))
    clone = conv.clone(parent=None, features=K * cin, feature_group_count=cin, use_bias=False, mask=None,
                       precision=jax.lax.Precision.HIGHEST)
    out = clone.apply({"params": {"kernel": jnp.asarray(one_hot)}}, x)
    out = out.reshape(out.shape[:-1] + (cin, K))
    return jnp.swapaxes(out, -1, -2).reshape(out.shape[:-2] + (K * cin,))


def conv_kernel_grads(conv: nn.Conv, x: jax.Array, g: jax.Array, kernel_shape: tuple[int, ...]) -> jax.Array:
    """Per-example kernel gradients [B, kernel size] of `conv` from its inputs x [B, 1, ...] and output
    gradients g [B, 1, ...]: the layer's own convolution differentiated in its kernel, per example (XLA
    runs the vmapped transpose as one grouped convolution). Exact for every padding mode, dilation and
    feature grouping, and never builds the im2col patches (K x the input). That one convolution may mix the
    examples' non-finite values (seen for grouped convs, which XLA rewrites with masks): callers pass finite
    examples only (the engine zeroes the others and drops them by their own check)."""
    clone = conv.clone(parent=None, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)
    xs = x if conv.dtype is None else x.astype(conv.dtype)   # the layer computes from its dtype's inputs
    kernel = jnp.zeros(kernel_shape, jnp.float32)           # linear in the kernel: any value gives the VJP

    def one(xb, gb):
        _, vjp = jax.vjp(lambda k: clone.apply({"params": {"kernel": k}}, xb), kernel)
        return vjp(gb)[0].reshape(-1)

    return jax.vmap(one)(xs.astype(jnp.float32), g.astype(jnp.float32))


def _input_grad_geometry(conv: nn.Conv, kernel: jax.Array, x: jax.Array) -> tuple[_ConvGeometry, list] | None:
    """(geometry, padding of the transposed convolution) where `conv_input_grad` applies, else None."""
    geo = _strided_geometry(conv, tuple(x.shape))
    nd = x.ndim - 2
    if (geo is None or len(geo.ks) != nd or conv.feature_group_count != 1 or jnp.result_type(kernel) != jnp.float32
            or jnp.result_type(x) != jnp.float32 or conv.dtype not in (None, jnp.float32)):
        return None
    pads = []
    for n, k, s, d, (lo, _), o in zip(x.shape[1:-1], geo.ks, geo.strides, geo.dil, geo.pads, geo.out):
        before = d * (k - 1) - lo   # the dilated kernel's extent less the forward's low padding
        pads.append((before, n + d * (k - 1) - s * (o - 1) - 1 - before))
    return geo, pads


def conv_input_grad(conv: nn.Conv, kernel: jax.Array, x: jax.Array, g: jax.Array) -> jax.Array:
    """The gradient of ⟨conv(x), g⟩ w.r.t. x [B, spatial..., C_in] (x: its shape and dtype), as ONE forward
    convolution of g with the spatially flipped kernel, input and output channels swapped (materialised), in
    the layer's own layout: the values of autodiff's transposed convolution, which XLA's CPU backend runs
    5-20x slower inside a loop (`batch_chunk`), where this form runs as fast as outside. Only where
    `_input_grad_geometry` applies: no groups or input dilation, SAME / VALID / explicit padding, one batch
    axis, float32."""
    geo, pads = _input_grad_geometry(conv, kernel, x)
    nd = x.ndim - 2
    flipped = jnp.flip(kernel, tuple(range(nd))).swapaxes(-1, -2)
    spec = (0, nd + 1) + tuple(range(1, nd + 1))
    numbers = jax.lax.ConvDimensionNumbers(spec, (nd + 1, nd) + tuple(range(nd)), spec)
    return jax.lax.conv_general_dilated(g, flipped, (1,) * nd, pads, lhs_dilation=geo.strides,
                                        rhs_dilation=geo.dil, dimension_numbers=numbers, precision=conv.precision)


def with_conv_input_grad(apply: Callable, conv: nn.Conv, own: dict, x: jax.Array) -> jax.Array:
    """apply(own, x) of a conv site, differentiated in x by `conv_input_grad` (in own as autodiff does);
    apply(own, x) itself where that form does not apply."""
    if _input_grad_geometry(conv, own["kernel"], x) is None:
        return apply(own, x)

    @jax.custom_vjp
    def layer(own, x):
        return apply(own, x)

    def forward(own, x):
        return apply(own, x), (own, x)

    def backward(res, g):
        own, x = res
        g_own = jax.vjp(lambda p: apply(p, x), own)[1](g)[0]  # dead code (dropped) where own is not differentiated
        return g_own, conv_input_grad(conv, own["kernel"], x, g)

    layer.defvjp(forward, backward)
    return layer(own, x)


def _linen_conv_of(conv: nnx.Conv) -> nn.Conv:
    return nn.Conv(features=conv.out_features, kernel_size=conv.kernel_size, strides=conv.strides,
                   padding=conv.padding, input_dilation=conv.input_dilation,
                   kernel_dilation=conv.kernel_dilation, feature_group_count=conv.feature_group_count,
                   use_bias=conv.use_bias, dtype=conv.dtype, precision=conv.precision)


class SharedRandomnessWarning(UserWarning):
    """The per-example loss draws random numbers with a key that is the same for every example."""


def _check_per_example_meaning(mod, method: str, args, kwargs) -> None:
    """Refuses layers whose meaning changes when the loss is evaluated one example at a time."""
    if isinstance(mod, (nn.BatchNorm, nnx.BatchNorm)) and method == "__call__":
        arg = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
        frozen = mod.use_running_average if arg is None else arg
        if not frozen:
            raise ValueError(
                f"BatchNorm {getattr(mod, 'name', None) or ''!r} runs in training mode "
                "(use_running_average=False). Per-example gradients evaluate the model one example at a "
                "time, so batch statistics would be each example's own (a different model from the "
                "batched one, whose statistics also mix the examples and break per-example clipping). "
                "Use GroupNorm or LayerNorm instead, or freeze the statistics (use_running_average=True, "
                "computed on public data).")


def _linen_apply(module, method, own, x):
    return module.apply({"params": own}, x, method=method)


def _nnx_apply(graphdef, state_def, names, method, own, x):
    layer = nnx.merge(graphdef, jax.tree.unflatten(state_def, [own[n] for n in names]))
    return getattr(layer, method)(x)


class _Tapper:
    """Interceptor state for one trace ('discover' or 'run') of linen and nnx layer calls."""

    def __init__(self, mode: str, leaves: Sequence[Any], site_leaves: Sequence[Any],
                 sites: Sequence[Site] | None = None, allowed: frozenset[int] = frozenset(),
                 taps: Sequence[Any] | None = None, tap: bool = True, conv_input_grads: bool = False):
        self.mode = mode
        self.tap = tap
        self.conv_input_grads = conv_input_grads   # run mode: conv sites differentiated by `conv_input_grad`
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

    def _linen_candidate(self, mod, method, args, kwargs) -> _Candidate | None:
        kind = _KINDS.get((type(mod), method))
        if kind is None or kwargs or len(args) != 1 or mod.scope is None:
            return None
        if kind == "dense" and isinstance(mod, nn.DenseGeneral) and mod.batch_dims:
            return None
        if kind == "conv" and mod.mask is not None:
            return None  # a masked kernel: its gradient is masked too (left to the exact fallback)
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
        clone = mod.clone(parent=None)
        axis = ()
        if kind == "dense":
            ax = mod.axis if isinstance(mod, nn.DenseGeneral) else -1
            ax = (ax,) if isinstance(ax, int) else tuple(ax)
            axis = tuple(sorted(a % args[0].ndim for a in ax))
        return _Candidate(kind, tuple(names), tuple(ids), functools.partial(_linen_apply, clone, method),
                          axis, clone if kind == "conv" else None)

    def _nnx_candidate(self, mod, method, args, kwargs) -> _Candidate | None:
        kind = _NNX_KINDS.get((type(mod), method))
        if kind is None or kwargs or len(args) != 1:
            return None
        if kind == "conv" and mod.mask is not None:
            return None
        graphdef, state = nnx.split(mod)
        flat, state_def = jax.tree_util.tree_flatten_with_path(state)
        names, ids = [], []
        for path, value in flat:
            idx = self.leaf_index.get(id(value))
            if idx is None or len(path) < 1:
                return None  # state that is not a parameter passed in (statistics, rngs, a cast, ...)
            names.append(str(getattr(path[0], "key", path[0])))
            ids.append(idx)
        if not names:
            return None
        apply = functools.partial(_nnx_apply, graphdef, jax.tree.structure(state), tuple(names), method)
        axis = (args[0].ndim - 1,) if kind == "dense" else ()
        return _Candidate(kind, tuple(names), tuple(ids), apply, axis,
                          _linen_conv_of(mod) if kind == "conv" else None)

    def _apply(self, apply, names, ids, x, conv=None):
        own = {n: self.site_leaves[i] for n, i in zip(names, ids)}
        self.bypass = True
        try:
            return apply(own, x) if conv is None else with_conv_input_grad(apply, conv, own, x)
        finally:
            self.bypass = False

    def intercept(self, mod, method, args, kwargs, call, nnx_layer=False):
        """One layer call: validated, then tapped when it is a recognised layer, else run as is."""
        if self.bypass:
            return call()
        if self.mode == "discover":
            _check_per_example_meaning(mod, method, args, kwargs)
            if not self.tap:
                return call()
        if _flax_tracers.current_trace() != self.trace:
            return call()
        cand = (self._nnx_candidate if nnx_layer else self._linen_candidate)(mod, method, args, kwargs)
        if cand is None:
            return call()
        if self.mode == "run" and (self.count >= len(self.sites) or self.sites[self.count].leaf_ids != cand.ids
                                   or self.sites[self.count].method != method):
            # not a site of the discovery trace: there every parameter was a tracer, so a parameter passed
            # through stop_gradient (a new tracer) was no leaf; called eagerly, stop_gradient returns the
            # concrete array itself and the layer would look like one. Run it as is (the count check at the
            # end still catches layer calls that really changed)
            return call()
        k = self.count
        self.count += 1
        x = args[0]
        if self.mode == "discover":
            out = self._apply(cand.apply, cand.names, cand.ids, x)
            self.sites.append(Site(k, cand.kind, type(mod).__name__, method, cand.apply, cand.names, cand.ids,
                                   tuple(x.shape), tuple(out.shape), out.dtype, cand.axis, cand.conv))
            return out
        # run mode
        site = self.sites[k]
        if site.kind != cand.kind or site.param_names != cand.names:
            raise RuntimeError("the model's layer calls changed between traces; the loss must be a "
                               "deterministic function of (params, batch)")
        if k not in self.allowed:
            return call()
        conv = site.conv if self.conv_input_grads and site.kind == "conv" else None
        out = self._apply(site.apply, cand.names, cand.ids, x, conv)
        self.records[k] = x
        return out + self.taps[k].astype(out.dtype)

    def __call__(self, next_fun, args, kwargs, context):   # the linen interceptor
        return self.intercept(context.module, context.method_name, args, kwargs,
                              lambda: next_fun(*args, **kwargs))


def _nnx_wrapper(cls, name, original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        tapper = _STATE.active
        if tapper is None or type(self) is not cls:
            return original(self, *args, **kwargs)
        return tapper.intercept(self, name, args, kwargs, lambda: original(self, *args, **kwargs),
                                nnx_layer=True)
    return wrapper


@contextlib.contextmanager
def _intercepting(tapper: _Tapper):
    """linen: flax's method interceptor. nnx (no interceptor API): the recognised layers' methods are
    wrapped on their classes for the duration of the trace; outside a trace the wrappers call through."""
    outer = _STATE.active
    _STATE.active = tapper
    patched = []
    if outer is None:
        for cls, name in list(_NNX_KINDS) + [(nnx.BatchNorm, "__call__")]:
            original = cls.__dict__[name]
            setattr(cls, name, _nnx_wrapper(cls, name, original))
            patched.append((cls, name, original))
    try:
        with nn.intercept_methods(tapper):
            yield
    finally:
        for cls, name, original in patched:
            setattr(cls, name, original)
        _STATE.active = outer


def _used_invars(closed_jaxpr) -> set:
    """The variables the outputs depend on DIFFERENTIABLY: backward liveness from the outputs, where `stop_gradient`
    passes nothing back (its derivative is zero) and an equation whose results are never read counts for nothing.
    Conservative everywhere else: one live result (or any effect) makes every input of an equation live, nested
    jaxprs included. So a parameter read only under stop_gradient (e.g. DPFormer's Re-Attention variances) or
    only by dead code has gradient 0 there and can still be tapped at its layer's sites."""
    jaxpr = closed_jaxpr.jaxpr
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name == "stop_gradient":
            continue
        if eqn.effects or any(isinstance(v, jex_core.Var) and v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return live


_RANDOM_DRAWS = ("random_bits", "threefry2x32")


def _sub_jaxprs(params) -> list:
    subs = []
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jex_core.ClosedJaxpr):
                subs.append(x.jaxpr)
            elif isinstance(x, jex_core.Jaxpr):
                subs.append(x)
    return subs


def shared_random_draws(jaxpr, tainted: Sequence[bool]) -> int:
    """Number of random draws in `jaxpr` whose key does not depend on the inputs marked `tainted`.

    Forward dependence analysis through nested jaxprs (jit, custom derivatives, scan, cond); inside
    constructs it cannot map input by input (while loops) it assumes every inner value depends on the
    example as soon as one input does, so it may miss a shared key there but never reports a false one."""
    return _taint(jaxpr, list(tainted))[1]


def _scan_counts(params) -> tuple[int, int]:
    """(constants, carries) among a `scan` equation's inputs: jax < 0.11 names the counts, later versions give
    the input structure as a flat tree (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _taint(jaxpr, tainted: list[bool]) -> tuple[list[bool], int]:
    env = dict(zip(jaxpr.invars, tainted))

    def t(v):
        return isinstance(v, jex_core.Var) and env.get(v, False)

    count = 0
    for eqn in jaxpr.eqns:
        ins = [t(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _RANDOM_DRAWS and not ins[0]:
            count += 1
        outs = [any(ins)] * len(eqn.outvars)
        subs = _sub_jaxprs(eqn.params)
        if name == "cond":     # branches see the operands after the branch index
            res = [_taint(b, ins[1:]) for b in subs]
            count += max(c for _, c in res)
            outs = [ins[0] or any(r[0][i] for r in res) for i in range(len(eqn.outvars))]
        elif name == "scan":   # carries may become example-dependent after the first iteration
            nc, nk = _scan_counts(eqn.params)
            inner = list(ins)
            while True:
                o, c = _taint(subs[0], inner)
                grown = [a or b for a, b in zip(inner[nc:nc + nk], o[:nk])]
                if grown == inner[nc:nc + nk]:
                    break
                inner[nc:nc + nk] = grown
            count += c
            outs = o
        elif len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(outs):
            outs, c = _taint(subs[0], ins)
            count += c
        else:
            count += sum(_taint(s, [any(ins)] * len(s.invars))[1] for s in subs)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [t(v) for v in jaxpr.outvars], count


@dataclasses.dataclass(frozen=True)
class RawMatmul:
    """A parameter read directly in a matrix product outside any recognised layer (`h @ embed.embedding.T`,
    a decoder's `z @ W.T` with the encoder's kernel W, the kernels of an RNN cell inside `nn.RNN` / `nn.scan`):
    one `dot_general` whose operand is the 2-D leaf (through transposes / dtype casts) contracted on ONE of its
    axes, no batch axes, in the loss's top-level jaxpr or in the body of a top-level `scan` that receives the
    leaf as a loop-invariant input. Its per-example gradient is Σ (activation)ᵀ·(output gradient) over the
    product's rows (and the scan's iterations), like a Dense kernel's or Embed.attend's."""
    index: int                      # order among the loss's tapped products
    leaf: int                       # the parameter leaf
    param_axis: int                 # axis of the leaf that the product contracts
    param_operand: int              # position of the parameter in dot_general: 0 (lhs) or 1 (rhs)
    act_axis: int                   # contracted axis of the other operand (the activation)
    out_shape: tuple[int, ...]      # of one product (one scan iteration)
    out_dtype: Any
    length: int = 0                 # inside a scan: its number of iterations (0: top level)
    body_eqn: int = -1              # inside a scan: the product's equation in the scan body
    part: tuple[int, ...] = ()      # (start, size): the leaf is this slice of a concatenation along the product's
                                    # free parameter axis (kernels packed side by side, as OptimizedLSTMCell does)
    act_size: int = 0               # elements of the recorded activation (one product)
    eqn: int = -1                   # its equation in the loss's top-level jaxpr (for a product in a scan: the scan)
    slot: int = -1                  # index of the tap / recorded activation it reads: its own, or for kernels packed
                                    # into one product that of the product's first leaf (one tap per product)

    @property
    def product(self) -> tuple[int, int]:
        """The product's identity: (top-level equation, equation in the scan body or -1)."""
        return self.eqn, self.body_eqn

    @property
    def tap_shape(self) -> tuple[int, ...]:
        """Shape of the tap added to the product's output (stacked over the scan's iterations)."""
        return (self.length, *self.out_shape) if self.length else self.out_shape


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which sites (and raw products) are tapped and which parameter leaves are covered / fallback / unused."""
    sites: tuple[Site, ...]
    allowed: frozenset[int]
    covered: frozenset[int]
    fallback: tuple[int, ...]
    loss_shape: tuple[int, ...]
    raw: tuple[RawMatmul, ...] = ()
    cheaper_whole: frozenset[int] = frozenset()   # read in scan products, but smaller whole (see below)


_CHAIN = ("transpose", "convert_element_type")  # ops through which a raw parameter may reach its product


def _uses(jaxpr) -> dict[Any, list[tuple[int, int]]]:
    uses: dict[Any, list[tuple[int, int]]] = {}
    for e, eqn in enumerate(jaxpr.eqns):
        for pos, v in enumerate(eqn.invars):
            if isinstance(v, jex_core.Var):
                uses.setdefault(v, []).append((e, pos))
    return uses


def _chain(jaxpr, uses, var, perm=(0, 1)) -> dict[Any, tuple[int, int]]:
    """{var: axis permutation of the leaf} for `var` and what transposes / casts make of it in `jaxpr`."""
    chain, todo = {var: perm}, [var]
    while todo:
        v = todo.pop()
        for e, _ in uses.get(v, ()):
            eqn = jaxpr.eqns[e]
            if eqn.primitive.name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
                chain[eqn.outvars[0]] = (chain[v][1], chain[v][0])
                todo.append(eqn.outvars[0])
            elif eqn.primitive.name == "convert_element_type":
                chain[eqn.outvars[0]] = chain[v]
                todo.append(eqn.outvars[0])
    return chain


def _products(jaxpr, uses, chains: dict[int, dict], in_scan: bool) -> tuple[list[tuple[int, RawMatmul]], set[int]]:
    """Raw products of the leaves whose vars in `jaxpr` are `chains` ({leaf: {var: perm}}): [(equation index,
    RawMatmul)] and the leaves with a use that is not such a product. At the top level (not `in_scan`), a leaf
    that is a loop-invariant input of a `scan` is followed into the scan's body (one level). `uses`: `_uses(jaxpr)`."""
    returned = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    on_chain = {var for chain in chains.values() for var in chain}
    found, bad = [], set()
    scans: dict[int, dict[int, dict]] = {}          # scan equation -> {leaf: chain in its body}
    body_uses: dict[int, dict] = {}
    for i, chain in chains.items():
        for var, perm in chain.items():
            if var in returned:
                bad.add(i)
            for e, pos in uses.get(var, ()):
                eqn = jaxpr.eqns[e]
                name = eqn.primitive.name
                if name in _CHAIN and eqn.outvars[0] in chain:
                    continue
                if name == "concatenate":
                    packed = _packed_products(jaxpr, uses, eqn, pos, i, perm, on_chain)
                    if packed is None:
                        bad.add(i)
                    else:
                        found += packed
                    continue
                if name == "scan" and not in_scan and pos < _scan_counts(eqn.params)[0]:
                    body = eqn.params["jaxpr"].jaxpr
                    inner = scans.setdefault(e, {}).setdefault(i, {})
                    if e not in body_uses:
                        body_uses[e] = _uses(body)
                    inner.update(_chain(body, body_uses[e], body.invars[pos], perm))
                    continue
                if name != "dot_general" or eqn.invars[1 - pos] in on_chain:
                    bad.add(i)
                    continue
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                contract = (lc, rc)
                if lb or rb or len(contract[pos]) != 1:
                    bad.add(i)
                    continue
                aval = eqn.outvars[0].aval
                found.append((e, RawMatmul(-1, i, perm[contract[pos][0]], pos, contract[1 - pos][0],
                                           tuple(aval.shape), aval.dtype,
                                           act_size=math.prod(eqn.invars[1 - pos].aval.shape))))
    for e, inner_chains in scans.items():
        length = int(jaxpr.eqns[e].params["length"])
        inner, inner_bad = _products(jaxpr.eqns[e].params["jaxpr"].jaxpr, body_uses[e], inner_chains, in_scan=True)
        bad |= inner_bad
        found += [(e, dataclasses.replace(r, length=length, body_eqn=b)) for b, r in inner]
    return found, bad


def _packed_products(jaxpr, uses, eqn, pos, leaf, perm, on_chain) -> list[tuple[int, RawMatmul]] | None:
    """Products of a leaf packed with others into one matrix (`concatenate` of 2-D operands along axis c) whose
    every use is a product contracting the OTHER axis: the leaf's output is a slice of the product's free axis.
    None when the packed matrix is used any other way (or returned)."""
    c = eqn.params["dimension"]
    sizes = [v.aval.shape[c] for v in eqn.invars]
    start, size = sum(sizes[:pos]), sizes[pos]
    out = eqn.outvars[0]
    found = []
    if len(out.aval.shape) != 2 or out in set(jaxpr.outvars):
        return None
    for e, p in uses.get(out, ()):
        use = jaxpr.eqns[e]
        if use.primitive.name != "dot_general" or use.invars[1 - p] in on_chain or use.invars[1 - p] is out:
            return None
        (lc, rc), (lb, rb) = use.params["dimension_numbers"]
        contract = (lc, rc)
        if lb or rb or len(contract[p]) != 1 or contract[p][0] == c:
            return None
        aval = use.outvars[0].aval
        found.append((e, RawMatmul(-1, leaf, perm[contract[p][0]], p, contract[1 - p][0], tuple(aval.shape),
                                   aval.dtype, part=(start, size), act_size=math.prod(use.invars[1 - p].aval.shape))))
    return found  # empty when the packed matrix is never used (dead code in the trace)


def raw_matmuls(jaxpr, n_leaves: int) -> tuple[list[tuple[int, RawMatmul]], set[int]]:
    """The raw matrix products of the first `n_leaves` inputs of `jaxpr` (the parameter leaves), as
    [(equation index, RawMatmul)] in equation order (for a product inside a scan, the scan's equation), and the
    leaves ALL of whose uses are such products (anything else — an elementwise op, a reshape, a product with
    another parameter on both sides, being returned, a nested transformation other than one top-level scan that
    takes the leaf as a loop invariant — leaves the parameter to the exact fallback)."""
    uses = _uses(jaxpr)
    chains = {i: _chain(jaxpr, uses, v) for i, v in enumerate(jaxpr.invars[:n_leaves])
              if len(getattr(v.aval, "shape", ())) == 2}
    found, bad = _products(jaxpr, uses, chains, in_scan=False)
    ok = {i for i in chains if uses.get(jaxpr.invars[i]) and i not in bad} & {r.leaf for _, r in found}
    found = sorted(found, key=lambda t: (t[0], t[1].body_eqn))
    return [(e, dataclasses.replace(r, index=k, eqn=e)) for k, (e, r) in enumerate(found)], ok


def _eval_tapped(closed, args, raw_at: dict[int, list[RawMatmul]], raw_taps):
    """Evaluates `closed` (a ClosedJaxpr) on `args`, adding raw_taps[r.slot] to the output of each raw product r
    and recording the product's other operand (the activation). raw_at: {equation: [RawMatmul]}, the product
    itself or, for products inside a scan, the scan, which then runs with the taps as extra per-iteration
    inputs and the activations as extra per-iteration outputs (stacked over iterations). Returns (outputs,
    {r.index: activation})."""
    jaxpr, env, recorded = closed.jaxpr, {}, {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    for e, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        at = raw_at.get(e, ())
        if at and at[0].length:
            outs, rec = _eval_scan_tapped(eqn, invals, at, raw_taps)
            recorded.update(rec)
        else:
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            for r in at:
                if r.slot == r.index:  # kernels packed into one product share its first leaf's tap and record
                    recorded[r.index] = invals[1 - r.param_operand]
                    out = out + raw_taps[r.index].astype(out.dtype)
            outs = out if eqn.primitive.multiple_results else [out]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars], recorded


def _eval_scan_tapped(eqn, invals, products: Sequence[RawMatmul], raw_taps):
    """A top-level `scan` equation evaluated by jax.lax.scan with its body interpreted by `_eval_tapped`: each
    iteration adds its slice of the products' taps and emits their activations."""
    p = eqn.params
    n_consts, n_carry = _scan_counts(p)
    consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
    inner_at: dict[int, list[RawMatmul]] = {}
    for r in products:  # plain products in the body
        inner_at.setdefault(r.body_eqn, []).append(dataclasses.replace(r, length=0))
    taps = {r.index: raw_taps[r.index] for r in products if r.slot == r.index}

    def body(carry, step):
        x, tap = step
        outs, rec = _eval_tapped(p["jaxpr"], [*consts, *carry, *x], inner_at, tap)
        return outs[:n_carry], (outs[n_carry:], rec)

    carry, (ys, rec) = jax.lax.scan(body, init, (xs, taps), length=p["length"], reverse=p["reverse"],
                                    unroll=p["unroll"])
    return [*carry, *ys], rec


def _scan_leaves_cheaper_whole(raw: Sequence[tuple[int, RawMatmul]], leaves: Sequence[Any]) -> set[int]:
    """Leaves of the scans whose kernels together are smaller than what tapping them records. Per scan (one
    decision for all its kernels: any fallback leaf already costs a per-example backward through the scan),
    tapping records each product's activation and output gradient at every iteration (length × (activation +
    output) elements per example), the fallback accumulates per-example gradients of the kernels' size.
    `benchmarks/clipping/rnn.py` (time relative to non-private): hidden 64 over 50 steps, tapped 2.9× (packed
    OptimizedLSTMCell kernels 4.0×) vs fallback 2.4× → fallback; hidden 128: tapped 2.4× vs 6.1× → tapped; hidden
    512 over 8 steps: 0.9× vs 16.8× → tapped."""
    recorded: dict[int, int] = {}
    read: dict[int, set[int]] = {}
    seen = set()
    for e, r in raw:
        if r.length:
            if (e, r.body_eqn) not in seen:  # kernels packed into one product share its one record
                seen.add((e, r.body_eqn))
                recorded[e] = recorded.get(e, 0) + r.length * (r.act_size + math.prod(r.out_shape))
            read.setdefault(e, set()).add(r.leaf)
    whole = set()
    for e, ids in read.items():
        if sum(int(np.size(leaves[i])) for i in ids) <= recorded[e]:
            whole |= ids
    return whole


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
        tapper = _Tapper("discover", lv, site_lv, tap=use_taps)
        with _intercepting(tapper):
            loss = per_example_loss(params, ex)
        holder["tapper"] = tapper
        holder["loss_shape"] = tuple(jnp.shape(loss))
        return loss

    closed = jax.make_jaxpr(fn)(leaf_structs, leaf_structs, ex_structs)
    tapper = holder["tapper"]
    n = len(leaves)
    n_shared = shared_random_draws(closed.jaxpr, [False] * (2 * n) + [True] * (len(closed.jaxpr.invars) - 2 * n))
    if n_shared:
        warnings.warn(
            f"the per-example loss makes {n_shared} random draw(s) with a key that does not depend on the "
            "example (e.g. a dropout key closed over in loss_fn): every example of the batch gets the same "
            "mask. Put one key per example into the batch (keys = jax.random.split(key, B)) and use it in "
            "loss_fn, e.g. model.apply(..., rngs={'dropout': batch['key'][0]}).",
            SharedRandomnessWarning, stacklevel=3)
    used = _used_invars(closed)
    invars = closed.jaxpr.invars
    direct = {i for i in range(n) if invars[i] in used}          # original leaf used outside sites
    via_site = {i for i in range(n) if invars[n + i] in used}     # leaf used by a site
    sites = tuple(tapper.sites)
    raw, raw_ok = raw_matmuls(closed.jaxpr, n) if use_taps else ([], set())
    cheaper_whole = _scan_leaves_cheaper_whole(raw, leaves) & raw_ok
    raw_ok -= cheaper_whole
    # A leaf used outside sites other than in raw products falls back, and so does every leaf of a module
    # with such a leaf (the module is not tapped at all); repeated until no site changes, so a leaf is either
    # tapped at EVERY use (sites and raw products) or differentiated whole by the fallback.
    fallback_leaves = direct - raw_ok
    while True:
        allowed = frozenset(s.index for s in sites if not (set(s.leaf_ids) & fallback_leaves))
        grown = fallback_leaves | {i for s in sites if s.index not in allowed for i in s.leaf_ids}
        if grown == fallback_leaves:
            break
        fallback_leaves = grown
    covered = ({i for s in sites if s.index in allowed for i in s.leaf_ids} | raw_ok) - fallback_leaves
    raw = [r for _, r in raw if r.leaf in covered]
    first: dict[tuple[int, int], int] = {}
    raw = tuple(dataclasses.replace(r, index=k, slot=first.setdefault(r.product, k)) for k, r in enumerate(raw))
    fallback = tuple(sorted((direct | via_site) - covered))
    return Plan(sites, allowed, frozenset(covered), fallback, holder["loss_shape"], raw, frozenset(cheaper_whole))


def per_example_bytes(plan: Plan, leaves: Sequence[Any]) -> int:
    """Bytes (float32) of one example's state in a pass with `plan`: the tapped sites' recorded inputs and output
    gradients, each raw product's recorded activations and output gradients (once for kernels packed into one
    product), the fallback leaves' per-example gradients."""
    n = sum(math.prod(s.in_shape) + math.prod(s.out_shape) for s in plan.sites if s.index in plan.allowed)
    n += sum(math.prod(r.tap_shape) + max(r.length, 1) * r.act_size for r in plan.raw if r.slot == r.index)
    n += sum(int(np.size(leaves[i])) for i in plan.fallback)
    return 4 * n


def run_per_example(per_example_loss: Callable, plan: Plan, leaves: Sequence[Any], treedef,
                    example: Any, conv_input_grads: bool = False):
    """Loss of one example and its gradients w.r.t. the site outputs, the raw products' outputs and the
    fallback leaves.

    Returns (loss [], records {site: input}, tap_grads {site: output grad}, fallback_grads list,
    raw_records {k: activation}, raw_grads {k: output grad}). Must be called under jax.vmap over examples
    (example has a leading axis of size 1 inside). With raw products the loss is traced to a jaxpr once and
    evaluated by `_eval_tapped`, which adds their taps (the layer sites' taps are already inside it).
    `conv_input_grads`: conv sites are differentiated in their input by `conv_input_grad` (inside a loop).
    """
    fb = list(plan.fallback)
    taps = {k: jnp.zeros(plan.sites[k].out_shape, plan.sites[k].out_dtype) for k in plan.allowed}
    raw_taps = {r.index: jnp.zeros(r.tap_shape, r.out_dtype) for r in plan.raw if r.slot == r.index}

    def traced(lv, site_lv, taps, ex):
        params = jax.tree.unflatten(treedef, lv)
        tapper = _Tapper("run", lv, site_lv, plan.sites, plan.allowed, taps, conv_input_grads=conv_input_grads)
        if plan.allowed:
            with _intercepting(tapper):
                loss = per_example_loss(params, ex)
        else:
            loss = per_example_loss(params, ex)
        if tapper.count != len(plan.sites) and plan.allowed:
            raise RuntimeError("the model's layer calls changed between traces")
        return jnp.reshape(loss, ()), tapper.records

    if plan.raw:
        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(list(leaves), list(leaves), taps, example)
        tapped_leaves = {r.leaf for r in plan.raw}
        found = [(e, r) for e, r in raw_matmuls(closed.jaxpr, len(leaves))[0] if r.leaf in tapped_leaves]
        key = [(r.leaf, r.param_axis, r.param_operand, r.act_axis, r.tap_shape, r.body_eqn, r.part) for _, r in found]
        if key != [(r.leaf, r.param_axis, r.param_operand, r.act_axis, r.tap_shape, r.body_eqn, r.part)
                   for r in plan.raw]:
            raise RuntimeError("the loss's matrix products changed between traces; the loss must be a "
                               "deterministic function of (params, batch)")
        raw_at: dict[int, list[RawMatmul]] = {}
        for (e, _), r in zip(found, plan.raw):
            raw_at.setdefault(e, []).append(r)
        out_tree = jax.tree.structure(out_shape)

    def f(fb_leaves, taps, raw_taps):
        lv = list(leaves)
        for i, x in zip(fb, fb_leaves):
            lv[i] = x
        if not plan.raw:
            loss, records = traced(lv, lv, taps, example)
            return loss, (records, {})
        outs, raw_records = _eval_tapped(closed, jax.tree.leaves((lv, lv, taps, example)), raw_at, raw_taps)
        loss, records = jax.tree.unflatten(out_tree, outs)
        return loss, (records, raw_records)

    (loss, (records, raw_records)), (g_fb, g_taps, g_raw) = jax.value_and_grad(
        f, argnums=(0, 1, 2), has_aux=True)([leaves[i] for i in fb], taps, raw_taps)
    return loss, records, g_taps, g_fb, raw_records, g_raw
