"""Convolution helpers of the taps: where a `flax.linen.Conv` reads its input (im2col patches, the mask of read
positions), its per-example kernel gradients from its own convolution, and its input gradient as one forward
convolution (`conv_input_grad`, used for conv sites inside a loop)."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import flax.linen as nn
from flax.linen.linear import canonicalize_padding
import jax
import jax.numpy as jnp
import numpy as np


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

