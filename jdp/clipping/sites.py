"""Sites: the calls of recognised Flax layers (linen and nnx) in the per-example loss, found and tapped by an
interceptor (`_Tapper`: linen's `intercept_methods`; nnx's layer methods wrapped for the trace only), and the
per-kind tables of the recognised (layer, method) pairs. Also refuses layers whose meaning changes when the loss
is evaluated one example at a time (BatchNorm in training mode)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import flax.linen as nn
from flax import nnx
from flax.core import tracers as _flax_tracers
import jax

from jdp.clipping.conv import with_conv_input_grad

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
