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

The pieces: `sites` (the recognised layers' tables and the interceptor), `products` (raw matrix products in
the loss's jaxpr), `conv` (patches and gradients of convolutions); here the plan (`discover`) and the pass
(`run_per_example`). Their public names are importable from here too.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np

from jdp.clipping.conv import (_input_grad_geometry, conv_input_grad, conv_kernel_grads,  # noqa: F401
                               conv_patches, conv_read_mask, patches_by_layer, with_conv_input_grad)
from jdp.clipping.products import RawMatmul, _eval_tapped, _scan_counts, raw_matmuls
from jdp.clipping.sites import SharedRandomnessWarning, Site, _intercepting, _Tapper  # noqa: F401


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
class Plan:
    """Which sites (and raw products) are tapped and which parameter leaves are covered / fallback / unused."""
    sites: tuple[Site, ...]
    allowed: frozenset[int]
    covered: frozenset[int]
    fallback: tuple[int, ...]
    loss_shape: tuple[int, ...]
    raw: tuple[RawMatmul, ...] = ()
    cheaper_whole: frozenset[int] = frozenset()   # read in scan products, but smaller whole (see below)



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
