"""`clipped_grad`: the sum of per-example (or per-user) clipped gradients of any Flax/JAX loss.

Contract: with g_n the gradient of unit n's loss (an example, or a user's examples summed)
over ALL trainable parameters, returns  sum_n clip(g_n)  with clip(g) = g * min(1, C/||g||), or
g * C/||g|| (normalised / "automatic" clipping), so the sum has L2 sensitivity C under add/remove of
one unit. Per-layer clipping splits C over parameter groups (sensitivity sqrt(sum_k C_k^2)).
The noise is NOT added here (see `jdp.clipping.dp_sgd`): this is the bounded-sensitivity query.

Methods:
  "auto" / "bk"       taps on recognised Flax layers, per-layer mixed ghost/instantiated norms, exact
                      cross-site terms, Phantom clipping for tied embeddings, book-keeping clipped sum
                      (one backward), exact vmap fallback for every other parameter.
  "ghost"             same, ghost norms for every matrix site (no instantiation).
  "ghost-two-pass"    norms as "auto", clipped sum from a second backward of sum_b c_b loss_b.
  "vmap"              reference: per-example gradients by jax.vmap(jax.grad) (memory B x params).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from typing import Any, Callable, Mapping, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jdp.clipping import norms as _norms
from jdp.clipping import taps as _taps
from jdp.noise import SUM_PRECISION
from jdp.validation import check_positive

METHODS = ("auto", "bk", "ghost", "ghost-two-pass", "vmap")
DEFAULT_MEMORY_LIMIT = 32 << 20  # bytes per chunk of instantiated per-example gradients (cache-sized)
# Output positions from which an instantiated conv takes its per-example kernel gradients from the layer's own
# transposed convolution instead of im2col patches: measured inside a DP step on CPU (ResNet-18/4 at B = 128,
# MNIST CNN at B = 256), it is as fast as the patch GEMM at 32x32 and 16x16 outputs and needs no patches
# (DP temp memory 863 -> 262 MiB), but slower at 14x14 and below, where the patches are small anyway
TRANSPOSED_CONV_MIN_POSITIONS = 256


@flax.struct.dataclass
class ClippedGrad:
    """Result of `clipped_grad`.

    grad_sum: pytree like params (float32 leaves whatever the parameters' dtype), sum over units of the clipped
      gradients (no noise, not averaged).
    norms: [N] per-unit gradient norms before clipping (N = B, or num_groups with group_ids); 0 for
      masked-out units. Private: do not release without accounting.
    loss: [B] per-example losses (as computed, also for masked-out rows: mask them with `where`).
    clip_factors: [N] factor applied to each unit's gradient (0 for masked-out units).
    group_norms: [N, K] norms per parameter group for per-layer clipping (None when flat).
    num_nonfinite: number of unmasked units whose loss or gradient was not finite (factor 0, norm inf:
      they contribute nothing to grad_sum).
    sensitivity: L2 sensitivity of grad_sum w.r.t. adding/removing one unit (static).
    """
    grad_sum: Any
    norms: jax.Array
    loss: jax.Array
    clip_factors: jax.Array
    group_norms: jax.Array | None
    num_nonfinite: jax.Array
    sensitivity: float = flax.struct.field(pytree_node=False, default=0.0)
    partition_labels: tuple = flax.struct.field(pytree_node=False, default=())

    @staticmethod
    def sensitivity_of(thresholds) -> float:
        """L2 sensitivity of a sum of units clipped to `thresholds` [K] per parameter group: sqrt(sum_k C_k^2) (the
        one place it is derived; C for flat clipping)."""
        return float(np.sqrt(np.sum(np.asarray(thresholds, np.float64) ** 2)))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _batch_size(batch) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch must contain at least one array with a leading batch axis")
    sizes = {int(np.shape(x)[0]) if np.ndim(x) > 0 else None for x in leaves}
    if None in sizes:
        raise ValueError("every array in batch must have a leading batch axis; got a scalar")
    if len(sizes) != 1:
        raise ValueError(f"batch arrays have mismatched leading (batch) sizes {sorted(sizes)}")
    B = sizes.pop()
    if B < 1:
        raise ValueError("batch is empty (batch size 0)")
    return B


def _partition(params, clip_partition) -> tuple[list[int], tuple]:
    """Label index per flattened leaf and the ordered label tuple."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if clip_partition is None:
        return [0] * len(paths), ("all",)
    if clip_partition == "per_layer":
        labels = [jax.tree_util.keystr(p[:-1]) if len(p) > 1 else jax.tree_util.keystr(p) for p in paths]
    elif callable(clip_partition):
        labels = [clip_partition(p) for p in paths]
    else:
        labels = jax.tree.leaves(jax.tree.map(lambda _, lab: lab, params, clip_partition))
        if len(labels) != len(paths):
            raise ValueError("clip_partition must be a pytree of labels with the structure of params")
    order = tuple(dict.fromkeys(labels))
    return [order.index(lab) for lab in labels], order


def _clip_values(l2_clip, labels: tuple) -> np.ndarray:
    if isinstance(l2_clip, Mapping):
        missing = [lab for lab in labels if lab not in l2_clip]
        if missing:
            raise ValueError(f"l2_clip has no threshold for parameter groups {missing}")
        return np.array([check_positive(l2_clip[lab], f"l2_clip[{lab!r}]") for lab in labels], np.float64)
    C = check_positive(l2_clip, "l2_clip")
    return np.full(len(labels), C / math.sqrt(len(labels)))


def lookup_rows(ids: jax.Array, num_embeddings: int) -> jax.Array:
    """Row of the table that `nn.Embed.__call__` reads for each id, or -1 where it reads none.

    Derived by the very call the layer makes (`jnp.take(table, ids, axis=0)`, default mode, the ids in
    their own dtype) on a table of row numbers, so the norms follow the model's semantics exactly:
    negative ids wrap (-1 is the last row), ids outside [-M, M) read no row (the layer returns NaN
    there and sends no gradient to the table), and with num_embeddings == 1 the layer broadcasts its
    only row to every id. No id is assumed to be padding: padding that must not reach the loss has to
    be masked by the model itself.
    """
    if num_embeddings == 1:
        return jnp.zeros(jnp.shape(ids), jnp.int32)
    rows = jnp.take(jnp.arange(num_embeddings, dtype=jnp.int32), ids, axis=0)
    return jnp.where((rows >= 0) & (rows < num_embeddings), rows, -1)


def _dense_site(site, pid, leaves, x, g, contribs, method, in_loop):
    """Dense (DenseGeneral): activations [B, T, p] (contracted axes last) and output gradients [B, T, q]."""
    B = g.shape[0]
    nd = len(site.in_shape)
    others = [i for i in range(nd) if i not in site.axis]
    p = int(math.prod(site.in_shape[i] for i in site.axis))
    a = jnp.transpose(x, [0] + [1 + i for i in others] + [1 + i for i in site.axis]).reshape(B, -1, p)
    T = a.shape[1]
    gf = g.reshape(B, T, -1)
    kid = pid["kernel"]
    contribs[kid].pq = (p, gf.shape[2])
    contribs[kid].mats.append((a.astype(jnp.float32), gf.astype(jnp.float32)))
    if "bias" in pid:
        contribs[pid["bias"]].insts.append(jnp.sum(gf, axis=1).astype(jnp.float32))


def _conv_site(site, pid, leaves, x, g, contribs, method, in_loop):
    """Conv: the kernel's per-example gradients from im2col patches (ghosted or instantiated), or from the layer's
    own transposed convolution (large outputs), block-diagonal over feature groups."""
    B = g.shape[0]
    kid = pid["kernel"]
    kshape = np.shape(leaves[kid])                 # kernel spatial... + (C_in / G, C_out)
    G, Q = site.conv.feature_group_count, kshape[-1]
    K, cg = int(math.prod(kshape[:-2])), kshape[-2]
    T = int(np.size(g)) // (B * Q)                  # output positions per example
    gf = g.reshape(B, T, Q).astype(jnp.float32)
    contribs[kid].pq = (K * cg, Q)
    if "bias" in pid:
        contribs[pid["bias"]].insts.append(jnp.sum(gf, axis=1))
    instantiate = method != "ghost" and _norms.instantiation_cheaper(T, K * cg, Q)
    read = _taps.conv_read_mask(site.conv, x.shape)
    xs = x if site.conv.dtype is None else x.astype(site.conv.dtype)   # as the layer casts it
    xs = xs if read is None else jnp.where(read, xs, 0)                 # the values the layer reads
    if G == 1 and instantiate and K * cg > Q and T >= TRANSPOSED_CONV_MIN_POSITIONS and not in_loop:
        # instantiated from the layer's own transposed convolution, without the im2col patches,
        # which would be larger than the layer's output (K * C_in > C_out) and many (T positions).
        # XLA runs it as ONE grouped convolution over the batch: each example's finiteness is checked
        # on what the layer reads, and only finite examples enter it, so no example's values can
        # reach another's gradient
        ok = (_norms.rows_finite(xs) & _norms.rows_finite(g)).reshape((B,) + (1,) * (x.ndim - 1))
        contribs[kid].checks += [xs, g]
        contribs[kid].insts.append(_taps.conv_kernel_grads(
            site.conv, jnp.where(ok, xs, 0), jnp.where(ok.reshape((B,) + (1,) * (g.ndim - 1)), g, 0),
            kshape))
        return
    # per-example kernel gradient = patches^T output grads (im2col): ghosted, or instantiated from
    # patches no larger than the output (e.g. a first layer on few input channels)
    pat = _taps.conv_patches(site.conv, x).astype(jnp.float32).reshape(B, -1, K, G, cg)
    if G > 1:  # block-diagonal over groups: instantiated ([K, C_in/G, G, C_out/G] = the kernel layout)
        u = jnp.einsum("btkgc,btgq->bkcgq", pat, gf.reshape(B, T, G, Q // G))
        contribs[kid].insts.append(u.reshape(B, -1))
        return
    pat = pat.reshape(B, T, K * cg)
    if read is not None:
        def patches(xz, conv=site.conv, T=T, P=K * cg):
            return _taps.conv_patches(conv, xz).astype(jnp.float32).reshape(B, T, P)
        # the patches hold exactly the read inputs (and zeros): finiteness is checked there, dropped
        # rows are zeroed in x (`norms.zero_rows`) and the patches built once from it
        contribs[kid].sources[len(contribs[kid].mats)] = (xs, patches)
    contribs[kid].mats.append((pat, gf))


def _lookup_site(site, pid, leaves, x, g, contribs, method, in_loop):
    """Embed lookup: the rows each example reads (`lookup_rows`) and their output gradients."""
    B = g.shape[0]
    eid = pid["embedding"]
    M, d = np.shape(leaves[eid])
    rows = lookup_rows(x.reshape(B, -1), M)
    R = g.reshape(B, rows.shape[1], d).astype(jnp.float32)
    valid = rows >= 0          # ids that read no row get no gradient (their output is NaN)
    R = jnp.where(valid[..., None], R, 0.0)
    contribs[eid].pq = (M, d)
    contribs[eid].lookups.append((jnp.where(valid, rows, 0), R))


def _attend_site(site, pid, leaves, x, g, contribs, method, in_loop):
    """Embed.attend (tied output): logit gradients [B, T, M] and queries [B, T, d]."""
    B = g.shape[0]
    eid = pid["embedding"]
    M, d = np.shape(leaves[eid])
    H = x.reshape(B, -1, d).astype(jnp.float32)
    G = g.reshape(B, H.shape[1], M).astype(jnp.float32)
    contribs[eid].pq = (M, d)
    contribs[eid].mats.append((G, H))


def _local_site(site, pid, leaves, x, g, contribs, method, in_loop):
    """Any other recognised layer: per-example VJP of the (small) layer itself."""
    B = g.shape[0]
    own = {n: leaves[i] for n, i in pid.items()}

    def one(xb, gb):
        _, vjp = jax.vjp(lambda p: site.apply(p, xb), own)
        return vjp(gb)[0]

    per = jax.vmap(one)(x, g)
    for n, i in pid.items():
        contribs[i].insts.append(per[n].reshape(B, -1).astype(jnp.float32))


_SITE_CONTRIBS = {"dense": _dense_site, "conv": _conv_site, "lookup": _lookup_site, "attend": _attend_site}


def _site_contribs(plan, leaves, records, tap_grads, contribs, method, in_loop=False):
    """Turns recorded inputs and output gradients of each site into factored leaf contributions (`in_loop`:
    see `_factored_grads`)."""
    for k in sorted(plan.allowed):
        site = plan.sites[k]
        pid = dict(zip(site.param_names, site.leaf_ids))
        add = _SITE_CONTRIBS.get(site.kind, _local_site)
        add(site, pid, leaves, records[k], tap_grads[k], contribs, method, in_loop)


def _raw_contribs(plan, leaves, records, grads, contribs, method, memory_limit):
    """Raw products (`h @ E.T`, `z @ W`): activation X [B, T, p] (contracted axis last) and output gradient
    G [B, T, q] (the parameter's free axis last) give the per-example gradient XᵀG of a [p, q] leaf (contracted
    on axis 0) or GᵀX of a [q, p] leaf (contracted on axis 1), factored like a Dense kernel / Embed.attend."""
    packed = {}
    for r in plan.raw:
        x, g = records[r.slot], grads[r.slot]
        B = g.shape[0]
        lead = 1 if r.length else 0   # inside a scan: records and gradients stacked over its iterations
        x = jnp.moveaxis(x, 1 + lead + r.act_axis, -1)
        X = x.reshape(B, -1, x.shape[-1]).astype(jnp.float32)
        if r.param_operand == 0:      # dot_general output: (parameter's free axis, activation's free axes)
            g = jnp.moveaxis(g, 1 + lead, -1)
        G = g.reshape(B, X.shape[1], -1).astype(jnp.float32)
        shape = np.shape(leaves[r.leaf])
        contribs[r.leaf].pq = tuple(shape)
        if r.part and method != "ghost" and 4 * B * X.shape[2] * G.shape[2] <= memory_limit and \
                _norms.instantiation_cheaper(X.shape[1], *shape):
            # kernels packed side by side (OptimizedLSTMCell): the whole packed matrix's per-example gradients
            # in one GEMM, each leaf its slice (instead of a strided copy of its columns per leaf)
            key = (r.eqn, r.body_eqn, r.param_axis)
            if key not in packed:
                packed[key] = (jnp.einsum("btp,btq->bpq", X, G) if r.param_axis == 0
                               else jnp.einsum("btq,btp->bqp", G, X))
            s0, n = r.part
            u = packed[key][:, :, s0:s0 + n] if r.param_axis == 0 else packed[key][:, s0:s0 + n, :]
            contribs[r.leaf].insts.append(u.reshape(B, -1))
            continue
        if r.part:                    # the leaf's slice of a packed (concatenated) matrix
            G = G[..., r.part[0]:r.part[0] + r.part[1]]
        contribs[r.leaf].mats.append((X, G) if r.param_axis == 0 else (G, X))


def _discover(loss_fn, leaves, treedef, batch, method):
    """The tapping plan of `loss_fn` (traced abstractly on one example of `batch`)."""
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) + tuple(np.shape(x)[1:]), jnp.result_type(x)),
                           batch)
    plan = _taps.discover(loss_fn, leaves, treedef, example, use_taps=(method != "vmap"))
    if plan.loss_shape != (1,):
        raise ValueError(f"loss_fn must return per-example losses of shape [B]; for a batch of 1 it "
                         f"returned shape {plan.loss_shape}")
    return plan


def _factored_grads(loss_fn, leaves, treedef, batch, method, memory_limit, plan=None, in_loop=False):
    """Tapping plan, per-example losses [B] and the factored per-example gradient of every leaf. `in_loop`:
    the batch is one chunk of a loop, where XLA's CPU backend runs autodiff's transposed convolutions 5-20x
    slower: conv sites are differentiated by `taps.conv_input_grad` and instantiated from patches."""
    B = _batch_size(batch)
    if plan is None:
        plan = _discover(loss_fn, leaves, treedef, batch, method)

    def pe(ex):
        ex1 = jax.tree.map(lambda x: x[None], ex)
        return _taps.run_per_example(loss_fn, plan, leaves, treedef, ex1, conv_input_grads=in_loop)

    losses, records, tap_grads, fb_grads, raw_records, raw_grads = jax.vmap(pe)(batch)
    contribs = {i: _norms.LeafContribs(tuple(np.shape(leaves[i]))) for i in range(len(leaves))}
    _site_contribs(plan, leaves, records, tap_grads, contribs, method, in_loop)
    _raw_contribs(plan, leaves, raw_records, raw_grads, contribs, method, memory_limit)
    for i, g in zip(plan.fallback, fb_grads):
        contribs[i].insts.append(g.reshape(B, -1).astype(jnp.float32))
    return plan, losses, contribs


def _with_aux(loss_fn, aux, params, batch):
    return loss_fn(params, batch, aux)


# ---------------------------------------------------------------------------------------------------
# A loss that mixes the examples of its batch (x - x.mean(0), batch statistics, attention across the batch):
# the engine evaluates it one example at a time, so it would train a different model from the batched one, and the
# batched loss's per-example gradients would each depend on other examples (per-example clipping bounds nothing).
# Refused at the first call, from the function's structure only: public synthetic inputs, never the batch's values.
MIXING_CHECK_ROWS = 3          # synthetic examples per evaluation: the middle one changes between the two
_MIXING_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loss_fn -> {checked signatures}
_MIXING_KEY = 0x6D6978         # public, fixed: the synthetic inputs are the same in every process


def _is_key_like(dtype, shape) -> bool:
    """Typed PRNG keys and raw keys (uint32 [..., 2] or [..., 4]): the check keeps them the same in both synthetic
    batches, so a loss that draws per-batch randomness from one example's key (the convention of `clipped_grad`) is
    not refused."""
    return (jnp.issubdtype(dtype, jax.dtypes.prng_key)
            or (dtype == jnp.uint32 and len(shape) >= 2 and shape[-1] in (2, 4)))


def _synthetic(rng: np.random.Generator, shape, dtype, fan_in_scaled: bool = False) -> np.ndarray:
    """Public random host values of `shape` and `dtype` (floats standard normal, or / sqrt(fan in) for parameters;
    integers in {0, 1}, valid ids and labels of any vocabulary; a typed key leaf as its uint32 key data)."""
    shape = tuple(shape)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return rng.integers(0, 1 << 32, shape + tuple(dtype._impl.key_shape), dtype=np.uint32)
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        x = rng.standard_normal(shape, np.float32)
        if fan_in_scaled and len(shape) >= 2:
            x = x / np.float32(math.sqrt(max(1, math.prod(shape[:-1]))))
        return x.astype(dtype)
    if dtype == jnp.bool_:
        return rng.random(shape) < 0.5
    return rng.integers(0, 2, shape).astype(dtype)


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def _mixing_losses(loss_fn, aux, params, batch) -> tuple[np.ndarray, np.ndarray] | None:
    """The batched loss of two synthetic batches that differ only in their middle example (keys kept), or None
    when the loss cannot be evaluated on them (nothing to conclude). Host values and one compiled program: it
    runs concretely even while a jitted step is being traced."""
    rng = np.random.default_rng(_MIXING_KEY)
    trees = (params, batch, aux)
    flat, treedefs = zip(*(jax.tree.flatten(t) for t in trees))
    dtypes = [[jnp.result_type(x) for x in leaves] for leaves in flat]
    shapes = [[tuple(np.shape(x)) for x in flat[0]], [(MIXING_CHECK_ROWS,) + tuple(np.shape(x))[1:] for x in flat[1]],
              [tuple(np.shape(x)) for x in flat[2]]]
    try:
        values = [[_synthetic(rng, s, d, fan_in_scaled=(i == 0)) for s, d in zip(shapes[i], dtypes[i])]
                  for i in range(3)]
    except Exception:  # noqa: BLE001 - a leaf this check cannot imitate (e.g. an unknown key type)
        return None
    mid = MIXING_CHECK_ROWS // 2
    second = []
    for x, d in zip(values[1], dtypes[1]):  # the middle example replaced (surely different), keys kept
        y = x.copy()
        if not _is_key_like(d, x.shape):
            y[mid] = (~x[mid] if x.dtype == np.bool_ else 1 - x[mid] if not jnp.issubdtype(d, jnp.inexact)
                      else _synthetic(rng, x.shape[1:], d))
        second.append(y)

    def run(p, b, a):
        def typed(tree_leaves, ds):
            return [jax.random.wrap_key_data(x, impl=d._impl) if jnp.issubdtype(d, jax.dtypes.prng_key) else x
                    for x, d in zip(tree_leaves, ds)]
        p, b, a = (jax.tree.unflatten(treedefs[i], typed(v, dtypes[i])) for i, v in enumerate((p, b, a)))
        return loss_fn(p, b) if aux is None else loss_fn(p, b, a)

    try:
        compiled = jax.jit(run).lower(values[0], values[1], values[2]).compile()  # one program for both batches
        out = [np.asarray(compiled(values[0], b, values[2]), np.float64) for b in (values[1], second)]
    except Exception:  # noqa: BLE001 - a loss that cannot run on synthetic inputs is not judged by them
        return None
    if any(o.shape != (MIXING_CHECK_ROWS,) for o in out):
        return None
    return out[0], out[1]


def check_per_example_loss(loss_fn: Callable, params: Any, batch: Any) -> None:
    """Refuses (ValueError) a loss whose value for one example depends on the other examples of its batch.

    Evaluates the BATCHED loss on two public synthetic batches of MIXING_CHECK_ROWS examples shaped like `batch`'s
    examples (random parameters of `params`' shapes, a fixed key) that differ only in their middle example, keys
    kept: a per-example loss gives the first and last examples the same loss in both. Depends only on the
    function and the shapes (never on the values of `params` or `batch`, which may be tracers); cached per
    function, parameter shapes and the examples' structure (dtypes and ranks), so a jitted step pays it once at
    trace time (one compilation of the loss on 3 examples: 0.1 s for an MLP, ~2 s for a 2-block Transformer on a
    busy 2-core CPU). A loss that cannot run on a batch of that size (or on synthetic values) is not judged."""
    raw, aux = loss_fn, None
    if isinstance(loss_fn, functools.partial) and loss_fn.func is _with_aux:
        raw, aux = loss_fn.args
    # per example: the structure, each leaf's dtype and rank, not its lengths (a sequence model compiles one step per
    # window length; mixing is a property of the function, so the first window's check stands for every window)
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) * (np.ndim(x) - 1), jnp.result_type(x)), batch)
    signature = (_signature(params), _signature(rows), None if aux is None else _signature(aux))
    try:  # held weakly: a closure's captured arrays are not kept alive by the cache
        seen = _MIXING_CHECKED.setdefault(raw, set())
    except TypeError:  # not weakly referenceable or not hashable: checked at every call
        seen = set()
    if signature in seen:
        return
    got = _mixing_losses(raw, aux, params, batch)
    if got is not None:
        a, b = got
        ends = np.array([0, MIXING_CHECK_ROWS - 1])
        a, b = a[ends], b[ends]
        same = (a == b) | (np.isnan(a) & np.isnan(b)) | (np.abs(a - b) <= 1e-5 * (np.abs(a) + np.abs(b)) + 1e-7)
        if not np.all(same):
            raise ValueError(
                "loss_fn mixes the examples of its batch: on synthetic inputs, changing one example changed the "
                f"loss of another ({a[~same][0]:.6g} -> {b[~same][0]:.6g}), e.g. x - x.mean(0), batch "
                "statistics or attention across the batch. clipped_grad evaluates the loss one example at a time, "
                "so it would train a different model from the batched one, and a batched loss's per-example "
                "gradients each depend on other examples, so clipping them bounds no one's influence. Compute "
                "every statistic per example (LayerNorm / GroupNorm instead of batch statistics) or from public "
                "data, and return per-example losses [B] that depend on their own example only.")
    seen.add(signature)


def clipped_grad(loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch: Any, *,
                 l2_clip: float | Mapping[Any, float], mask: jax.Array | None = None,
                 method: str = "auto", normalize: bool = False, group_ids: jax.Array | None = None,
                 num_groups: int | None = None, clip_partition: Any = None,
                 memory_limit: int = DEFAULT_MEMORY_LIMIT, matmul_precision: str | None = SUM_PRECISION,
                 aux: Any = None, batch_chunk: int | str | None = "auto") -> ClippedGrad:
    """Sum of per-example (or per-group) clipped gradients, exactly, without B x params memory.

    Args:
      loss_fn: loss_fn(params, batch) -> per-example losses [B]. It is evaluated one example at a time
        (a batch of size 1, under jax.vmap), so every unit's gradient is exactly its own; for per-example
        dropout put a per-example PRNG key into `batch`. May apply any flax.linen module inside.
      params: pytree of float arrays (the trainable parameters).
      aux: optional pytree shared by every example and not differentiated; given, the loss is called as
        loss_fn(params, batch, aux). Inside a jitted step it is an input of the program instead of a
        constant baked into it, so a new value (e.g. from a new release) does not recompile. It is the same
        for every example: anything data-dependent in it must be released (accounted) or public.
      batch: pytree of arrays with a common leading axis B.
      l2_clip: clipping threshold C > 0 (or {label: C_k} with `clip_partition`).
      mask: [B] bool/0-1 indicator, False for padding examples (static-shape Poisson batches); other
        values raise (a mask never weights an example).
      method: "auto" (= "bk"), "ghost", "ghost-two-pass" or "vmap" (reference).
      normalize: normalised clipping g * C/||g|| instead of g * min(1, C/||g||).
      group_ids: [B] ints in [0, num_groups): examples of one unit (user) are clipped together.
      num_groups: number of units (static); default B.
      clip_partition: None (flat), "per_layer" (one group per module), a callable(key_path) -> label,
        or a pytree of labels like params. A float l2_clip is split equally (C/sqrt(K) per group).
      memory_limit: bytes allowed for instantiated per-example gradients of one leaf (chunked beyond).
      batch_chunk: examples whose per-example pass runs together; the batch runs as a loop over such chunks
        (`jax.lax.scan`) and their clipped sums add up (the result is the same up to float rounding of the sum).
        "auto" (default): on CPU, chunks whose per-example state (recorded layer inputs and output
        gradients, raw products, fallback gradients) is about CPU_CHUNK_BYTES, at least MIN_CHUNK examples
        (cache-sized: faster and smaller on the CNN, RNN and Transformer models of
        `benchmarks/clipping/external.py`), and fewer where the per-example gradients that the mixed rule
        instantiates would not fit `memory_limit` at once (formed in one piece, they are weighted for the
        clipped sum instead of a second product over their factors); on GPU/TPU the whole batch.
        None: the whole batch; an int: that many examples. With group_ids the whole batch (a unit's examples
        must be clipped together). A batch that is not a multiple is padded with masked-out rows.
      matmul_precision: precision of every matmul traced here (`jax.default_matmul_precision`).
        "highest" (default, `jdp.noise.SUM_PRECISION`) keeps float32: on GPUs the default TF32 matmuls
        computed the norms and the clipped sum with different rounding, and one example's contribution measured up to
        1.00036·C on an H100. None keeps the caller's setting (faster there; the bound then holds
        only up to that rounding).

    Embedding lookups use the rows nn.Embed itself reads (`lookup_rows`): -1 is the last row, not
    padding. Masked-out examples and examples whose loss or gradient is not finite never reach grad_sum:
    a chunk whose norms, taken from its factors as recorded (a NaN or inf in any factor shows there), and
    losses are all finite is summed with weight 0 on masked rows; any other chunk is recomputed with those
    examples' factors set to exact zeros by `where` before any norm or sum. A non-finite unmasked unit
    contributes nothing and is counted in num_nonfinite, a private diagnostic (nothing is raised:
    a private computation never changes course on a property of the data).

    A loss whose value for one example depends on the other examples of its batch (x - x.mean(0), batch
    statistics, attention across the batch) is refused with ValueError at the first call for its structure
    (`check_per_example_loss`, on public synthetic inputs): evaluated one example at a time it would be another model.

    Unit of privacy: one example (or one group_ids unit); neighbouring relation add/remove one unit.
    Returns a ClippedGrad; grad_sum has L2 sensitivity `sensitivity`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if aux is not None:
        loss_fn = functools.partial(_with_aux, loss_fn, aux)
    precision = (contextlib.nullcontext() if matmul_precision is None
                 else jax.default_matmul_precision(matmul_precision))
    with precision:
        B = _batch_size(batch)
        leaves, treedef = _check_params(params, method)
        leaf_label, labels = _partition(params, clip_partition)
        thresholds = _clip_values(l2_clip, labels)
        part = _units(mask, group_ids, num_groups, B)
        taps = _discover(loss_fn, leaves, treedef, batch, method)
        check_per_example_loss(loss_fn, params, batch)  # after discover: BatchNorm gets its own message first
        cp = _ClipPlan(loss_fn, taps, params, leaves, treedef, thresholds, leaf_label, labels, method, normalize,
                       memory_limit)
        chunk = B if group_ids is not None else _chunk_size_of(batch_chunk, loss_fn, taps, leaves, treedef, batch,
                                                               method, memory_limit)
        if chunk >= B:
            return _clip_batch(cp, part._replace(batch=batch))
        return _clip_in_chunks(cp, batch, part.w, chunk)


def _check_params(params, method) -> tuple[list, Any]:
    """(leaves, treedef) of `params` after checking they are floating-point (float32 or wider for ghost-two-pass)."""
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        raise ValueError("params is empty")
    for x in leaves:
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError("params must contain only floating-point arrays")
    if method == "ghost-two-pass" and any(jnp.finfo(jnp.result_type(x)).bits < 32 for x in leaves):
        raise ValueError("method='ghost-two-pass' forms the clipped sum by a second backward in the parameters' "
                         "dtype; with bfloat16/float16 parameters that sum would round to 8-11 bits: use "
                         "method='auto' (the sum is formed in float32, see docs/clipping.md#mixed-precision)")
    return leaves, treedef


def _units(mask, group_ids, num_groups, B: int) -> _Part:
    """The row indicator w [B], group_ids and the number of units N of a call (its batch filled in later), after
    checking `mask` and `group_ids`."""
    if mask is None:
        w = jnp.ones((B,), jnp.float32)
    else:
        mask = jnp.asarray(mask)
        if mask.shape != (B,):
            raise ValueError(f"mask must have shape ({B},) like the batch, got {mask.shape}")
        if _is_concrete(mask) and not np.all(np.isin(np.asarray(mask), (0, 1))):
            raise ValueError("mask must hold only 0/1 (or bool) values: a weight other than 1 would scale an "
                             "example's clipped gradient beyond the sensitivity")
        w = (mask != 0).astype(jnp.float32)   # a 0/1 indicator, never a weight
    if group_ids is None:
        return _Part(None, w, None, B)
    group_ids = jnp.asarray(group_ids)
    if group_ids.shape != (B,) or not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be an integer array of shape ({B},), got "
                         f"{group_ids.dtype}{tuple(group_ids.shape)}")
    N = B if num_groups is None else int(num_groups)
    if N < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if _is_concrete(group_ids) and (np.asarray(group_ids).min() < 0 or np.asarray(group_ids).max() >= N):
        raise ValueError(f"group_ids must lie in [0, num_groups={N})")
    # (under jit) an id outside [0, N) belongs to no unit: the example is dropped, never clipped
    # with another unit's factor
    w = jnp.where((group_ids >= 0) & (group_ids < N), w, 0.0)
    return _Part(None, w, group_ids, N)


def _clip_in_chunks(cp: _ClipPlan, batch, w, chunk: int) -> ClippedGrad:
    """`clipped_grad` as a `lax.scan` over chunks of at most `chunk` examples, the clipped sum in the carry."""
    B = _batch_size(batch)
    chunked_batch, chunked_w = split_into_chunks(batch, w, chunk)
    nb, chunk = chunked_w.shape

    def step(acc, part):            # the clipped sum accumulates in the carry (no [chunks, params] stack)
        r = _clip_batch(cp, _Part(part[0], part[1], None, chunk), in_loop=True)
        return jax.tree.map(jnp.add, acc, r.grad_sum), r.replace(grad_sum=None)

    zeros = jax.tree.map(lambda x: jnp.zeros(np.shape(x), jnp.float32), cp.params)   # the sum stays float32
    grad_sum, parts = jax.lax.scan(step, zeros, (chunked_batch, chunked_w))

    def rows(x):
        return None if x is None else x.reshape((nb * chunk,) + x.shape[2:])[:B]

    return cp.result(grad_sum=grad_sum, norms=rows(parts.norms), loss=rows(parts.loss),
                     clip_factors=rows(parts.clip_factors), group_norms=rows(parts.group_norms),
                     num_nonfinite=jnp.sum(parts.num_nonfinite))


def split_into_chunks(batch, w: jax.Array, chunk: int):
    """(batch, w [B]) with their leading axis laid out as [nb, c, ...] for a `lax.scan` over chunks:
    nb = ceil(B / chunk) balanced chunks of c ≤ chunk examples (fewer than nb padding rows). Padding rows
    repeat the last example and get w = 0 (False for a boolean mask), so they add nothing to a weighted sum."""
    B = _batch_size(batch)
    nb = -(-B // chunk)
    chunk = -(-B // nb)
    pad = nb * chunk - B

    def split(x, fill=None):
        if pad:
            extra = jnp.repeat(x[-1:], pad, axis=0) if fill is None else jnp.full((pad,), fill, x.dtype)
            x = jnp.concatenate([x, extra])
        return x.reshape((nb, chunk) + x.shape[1:])
    return jax.tree.map(split, batch), split(jnp.asarray(w), fill=0)


# `batch_chunk="auto"` on CPU: per-example state of one chunk (`_taps.per_example_bytes`) and the smallest chunk.
# Measured in one process per model (2-core CPU, B = 256, gradient only, time / temp memory relative to the
# non-private gradient): LSTM classifier whole batch 1.95x/1.79x, chunks of 8 / 16 / 32 (auto) 2.55x / 1.61x /
# 1.42x with the chunk sums stacked, 1.18x/0.23x for 32 with the sum in the scan carry; tied LM (chunks of 16,
# auto) 1.18x/0.12x. Convolutions too, since conv sites inside the loop are differentiated by
# `taps.conv_input_grad` (autodiff's transposed convolutions ran 5-20x slower there: DP ResNet-18/4 at B = 128 in
# chunks of 32 took 5.1 s vs 0.73 s whole; now 0.75 s): one DP Adam step ÷ non-private, same process, MNIST CNN
# whole 1.45x/1.99x, chunks of 32 (auto) 0.94x/0.37x; ResNet-18/4 whole 1.57x/1.20x, chunks of 16 (auto)
# 1.27x/0.52x.
CPU_CHUNK_BYTES = 8 << 20
MIN_CHUNK = 16


def _one_piece_limit(loss_fn, plan, leaves, treedef, batch, method, memory_limit) -> int | None:
    """Most examples whose per-example gradients of every leaf that the mixed rule instantiates fit
    `memory_limit` at once (in a chunk of at most that many they are formed in one piece and kept for the
    clipped sum: `norms.LeafContribs.dense`); None when no leaf is instantiated from products. Traced
    abstractly on one example of the chunked pass."""
    mth = "ghost" if method == "ghost" else "auto"
    sizes = []

    def trace(lv, b):
        _, _, contribs = _factored_grads(loss_fn, lv, treedef, b, method, memory_limit, plan, in_loop=True)
        sizes.extend(math.prod(c.pq) for c in contribs.values() if c.mats and _norms.choose_instantiate(c, mth))
        return jnp.zeros(())

    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,) + tuple(np.shape(x))[1:], jnp.result_type(x)), batch)
    jax.eval_shape(trace, [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves], one)
    return min((memory_limit // (4 * s) for s in sizes), default=None)


def _chunk_size_of(batch_chunk, loss_fn, plan, leaves, treedef, batch, method, memory_limit) -> int:
    """Examples per chunk (B: the whole batch) for the `batch_chunk` argument; "auto" stays at or below
    `_one_piece_limit`."""
    batch_chunk, B = check_batch_chunk(batch_chunk), _batch_size(batch)
    if batch_chunk is None:
        return B
    if batch_chunk == "auto":
        if jax.default_backend() != "cpu":
            return B
        per_example = max(_taps.per_example_bytes(plan, leaves), 1)
        chunk = max(MIN_CHUNK, CPU_CHUNK_BYTES // per_example)
        one_piece = _one_piece_limit(loss_fn, plan, leaves, treedef, batch, method, memory_limit)
        if one_piece is not None:
            chunk = max(1, min(chunk, one_piece))
        return min(B, 1 << (int(chunk).bit_length() - 1))   # a power of two
    return min(B, batch_chunk)


def check_batch_chunk(batch_chunk):
    """`batch_chunk` itself if it is 'auto', None or a positive int, else ValueError."""
    if batch_chunk is None or (isinstance(batch_chunk, str) and batch_chunk == "auto"):
        return batch_chunk
    if isinstance(batch_chunk, bool) or not isinstance(batch_chunk, (int, np.integer)) or batch_chunk < 1:
        raise ValueError(f"batch_chunk must be 'auto', None or a positive int, got {batch_chunk!r}")
    return int(batch_chunk)


@dataclasses.dataclass(frozen=True, eq=False)
class _ClipPlan:
    """Everything fixed for one call of `clipped_grad`, passed down to every chunk: the loss, the tapping plan, the
    flattened parameters, the parameter groups with their clip bounds and the clipping settings."""
    loss_fn: Callable
    taps: Any                     # taps.discover's plan (sites, raw products, fallback leaves)
    params: Any
    leaves: list
    treedef: Any
    thresholds: np.ndarray        # [K] clip bound C_k of each parameter group (float64)
    leaf_label: list[int]         # group index of each flattened leaf
    labels: tuple                 # the K group labels
    method: str
    normalize: bool
    memory_limit: int

    @property
    def num_groups(self) -> int:
        return len(self.labels)

    @property
    def norm_method(self) -> str:
        """The norms' method (`norms.sq_norms_diag`): "ghost" or "auto" (mixed)."""
        return "ghost" if self.method == "ghost" else "auto"

    def result(self, **fields) -> "ClippedGrad":
        """A ClippedGrad of this plan: its static sensitivity and group labels added to `fields`."""
        return ClippedGrad(**fields, sensitivity=ClippedGrad.sensitivity_of(self.thresholds),
                           partition_labels=self.labels)


class _Part(NamedTuple):
    """One batch, or one chunk of a loop, as `_clip_batch` clips it."""
    batch: Any
    w: jax.Array                  # [B] 0/1 row indicator
    group_ids: jax.Array | None   # [B] unit of each row (None: each row its own unit)
    num_units: int                # N


def _clip_batch(cp: _ClipPlan, part: _Part, in_loop: bool = False) -> ClippedGrad:
    """`clipped_grad` on one batch (or `in_loop`: one chunk of a loop) with the 0/1 row indicator part.w [B]
    (validated by the caller).

    Per-example norms without groups first come from the factors as recorded: a NaN or inf in any factor
    of an example makes its squared norm non-finite (`norms.sq_norms_diag`), so when every row's norm and
    loss is finite, masked rows and all, no factor holds one and the clipped sum is taken from them
    directly. Otherwise (`lax.cond`) the chunk is recomputed on the checked path, which zeroes the factors
    of every dropped example before any norm or sum (`_clip_checked`). Both give the same result on
    finite inputs; the first skips a check and a zeroed copy of every factor (the largest, a tied output
    layer's [B, T, vocabulary] logit gradients, costs passes as long as its matmuls)."""
    B = _batch_size(part.batch)
    _, losses, contribs = _factored_grads(cp.loss_fn, cp.leaves, cp.treedef, part.batch, cp.method, cp.memory_limit,
                                          cp.taps, in_loop)
    if (part.group_ids is not None or cp.method == "ghost-two-pass"
            or any(c.checks for c in contribs.values())):   # (`checks`: inputs of a batch-mixing op)
        return _clip_checked(cp, part, losses, contribs)
    bound = _diag_sq_norms(cp, contribs, B, zeroed=False)
    clean = jnp.all(jnp.isfinite(bound[0])) & jnp.all(jnp.isfinite(bound[1])) & jnp.all(jnp.isfinite(losses))
    fresh = {i: dataclasses.replace(c, dense=None) for i, c in contribs.items()}   # as before any norm
    w = part.w
    return jax.lax.cond(clean, lambda: _finish(cp, part, losses, contribs, bound, w, w > 0, jnp.zeros((B,), bool),
                                               all_finite=True),
                        lambda: _clip_checked(cp, part, losses, fresh))


def _diag_sq_norms(cp: _ClipPlan, contribs, B, zeroed=True) -> tuple[jax.Array, jax.Array]:
    """Certified bounds (q [B, K], lin [B, K]) per example and parameter group: the vector summed for an example's
    group k has norm ≤ √q + lin (`norms.sq_norms_diag`; the leaves' linear terms add as orthogonal parts)."""
    K = cp.num_groups
    q = [jnp.zeros((B,), jnp.float32) for _ in range(K)]
    lin2 = [jnp.zeros((B,), jnp.float32) for _ in range(K)]
    for i, c in contribs.items():
        if c.mats or c.lookups or c.insts:
            qi, li = _norms.sq_norms_diag(c, cp.norm_method, cp.memory_limit, zeroed)
            q[cp.leaf_label[i]] = q[cp.leaf_label[i]] + qi
            lin2[cp.leaf_label[i]] = lin2[cp.leaf_label[i]] + li * li
    return jnp.stack(q, axis=1), jnp.sqrt(jnp.stack(lin2, axis=1))


def _group_sq_norms(cp: _ClipPlan, contribs, keep, group_ids, N) -> tuple[jax.Array, jax.Array]:
    """Certified bounds (q [N, K], lin [N, K]) per group_ids unit and parameter group, from the examples kept."""
    B, K = keep.shape[0], cp.num_groups
    # ||sum_{b in n} g_b||^2 = sum over pairs (b, c) of unit n of <g_b, g_c>; pairs of other units
    # are excluded with `where` (not multiplied by 0) so no other unit's value can leak in.
    same = (group_ids[:, None] == group_ids[None, :]) & keep[:, None] & keep[None, :]
    q = [jnp.zeros((N,), jnp.float32) for _ in range(K)]
    lin2 = [jnp.zeros((N,), jnp.float32) for _ in range(K)]
    for i, c in contribs.items():
        if c.mats or c.lookups or c.insts:
            Kb, Sb, beta, lin_b = _norms.sq_norms_pairs(c, cp.norm_method)
            rows = jnp.sum(jnp.where(same, Kb, 0.0), axis=1)
            unit = jax.ops.segment_sum(rows, group_ids, num_segments=N)
            # the unit's sum of pairs, then its two sums over ≤ B terms: off by ≤ (β + γ_{2B+2}) (Σ_{b∈n} S_b)²
            S_unit = jax.ops.segment_sum(jnp.where(keep, Sb, 0.0), group_ids, num_segments=N)
            S_unit = S_unit * (1.0 + _norms.gamma(B + 1))
            err = (beta + _norms.gamma(2 * B + 2) * (1.0 + beta)) * S_unit * S_unit
            lin = jax.ops.segment_sum(jnp.where(keep, lin_b, 0.0), group_ids, num_segments=N)
            q[cp.leaf_label[i]] = q[cp.leaf_label[i]] + jnp.maximum(unit, 0.0) + err
            lin2[cp.leaf_label[i]] = lin2[cp.leaf_label[i]] + lin * lin * (1.0 + _norms.gamma(B + 1)) ** 2
    return jnp.stack(q, axis=1), jnp.sqrt(jnp.stack(lin2, axis=1))


def _clip_checked(cp: _ClipPlan, part: _Part, losses, contribs) -> ClippedGrad:
    """The checked path of `_clip_batch`: dropped examples' factors zeroed before any norm or sum."""
    w, group_ids, N = part.w, part.group_ids, part.num_units
    B = w.shape[0]
    # An example is dropped (all its factors set to exact zeros with `where`, before any norm or sum)
    # when it is masked out or when its loss or any factor of its gradient is not finite: 0 * NaN is
    # NaN, so a zero weight alone would let a padding row's NaN poison every sum it enters.
    ex_finite = _norms.finite_rows(contribs) & jnp.isfinite(losses)
    keep = (w > 0) & ex_finite
    _norms.zero_rows(contribs, keep)
    ex_bad = (w > 0) & ~ex_finite                                     # counted in num_nonfinite

    # Squared norms per parameter group k, per unit n.
    if group_ids is None:
        return _finish(cp, part, losses, contribs, _diag_sq_norms(cp, contribs, B), w, keep, ex_bad)
    bound = _group_sq_norms(cp, contribs, keep, group_ids, N)
    unit_w = (jax.ops.segment_max(w, group_ids, num_segments=N) > 0).astype(jnp.float32)
    unit_bad = jax.ops.segment_max(ex_bad.astype(jnp.int32), group_ids, num_segments=N) > 0
    return _finish(cp, part, losses, contribs, bound, unit_w, keep, unit_bad)


def _clip_factors(cp: _ClipPlan, bound, unit_w, unit_bad):
    """(factors [N, K], group norms [N, K], total norms [N], number of non-finite units) from the certified bounds.

    A unit's norm in group k is √q + lin, raised by the slack of forming it (`norms.BOUND_SLACK`) and by a floor
    for underflow (`norms.ABS_FLOOR`): an upper bound on the norm of what `grad_sum` receives from the unit, so its
    clipped contribution is ≤ C_k (docs/privacy.md#floating-point)."""
    q, lin = bound
    if _norms._FP_BOUND:
        n_leaves = [cp.leaf_label.count(k) for k in range(cp.num_groups)]   # q and lin: sums over a group's leaves
        slack = jnp.asarray([_norms.BOUND_SLACK * (1.0 + _norms.gamma(n + 1)) for n in n_leaves],
                            jnp.float32)[None, :]
        gnorms = (jnp.sqrt(q) + lin) * slack + _norms.ABS_FLOOR
    else:
        gnorms = jnp.sqrt(jnp.maximum(q, 0.0))
    # a norm that overflows is not finite either: the unit is dropped like a NaN one
    finite = ~unit_bad & jnp.all(jnp.isfinite(gnorms), axis=1)
    Cs_j = jnp.asarray(cp.thresholds, jnp.float32)[None, :]
    safe = jnp.where(jnp.isfinite(gnorms), gnorms, 1.0)
    if cp.normalize:
        factors = Cs_j / jnp.maximum(safe, 1e-12)
    else:
        factors = jnp.minimum(1.0, Cs_j / jnp.maximum(safe, 1e-12))
    factors = jnp.where(((unit_w > 0) & finite)[:, None], factors, 0.0)   # [N, K]
    gnorms = jnp.where((unit_w > 0)[:, None], gnorms, 0.0)
    total_norms = jnp.sqrt(jnp.sum(jnp.where(jnp.isfinite(gnorms), gnorms, 0.0) ** 2, axis=1))
    total_norms = jnp.where(finite | (unit_w == 0), total_norms, jnp.inf)
    return factors, gnorms, total_norms, jnp.sum((~finite) & (unit_w > 0))


def _bookkeeping_sum(cp: _ClipPlan, contribs, ex_factors, all_finite):
    """The clipped sum (float32 leaves) from the factors, each example's group k weighted by ex_factors[:, k]."""
    out = []
    for i, x in enumerate(cp.leaves):
        c = contribs[i]
        if c.mats or c.lookups or c.insts:
            out.append(_norms.clipped_sum(c, ex_factors[:, cp.leaf_label[i]], all_finite))   # float32
        else:
            out.append(jnp.zeros(np.shape(x), jnp.float32))
    return jax.tree.unflatten(cp.treedef, out)


def _two_pass_sum(cp: _ClipPlan, batch, ex_factors, bookkeeping: Callable):
    """The clipped sum from a second backward of Σ_b c_b loss_b ("ghost-two-pass"), one per parameter group."""
    def weighted(p):
        return jax.vmap(lambda ex: jnp.reshape(cp.loss_fn(p, jax.tree.map(lambda x: x[None], ex)), ()))(batch)

    if cp.num_groups == 1:
        grad_sum = jax.grad(lambda p: jnp.dot(jax.lax.stop_gradient(ex_factors[:, 0]), weighted(p)))(cp.params)
    else:
        # one backward per parameter group, keeping that group's leaves
        out = [None] * len(cp.leaves)
        for k in range(cp.num_groups):
            gk = jax.grad(lambda p, k=k: jnp.dot(jax.lax.stop_gradient(ex_factors[:, k]), weighted(p)))(cp.params)
            for i, x in enumerate(jax.tree.leaves(gk)):
                if cp.leaf_label[i] == k:
                    out[i] = x
        grad_sum = jax.tree.unflatten(cp.treedef, out)
    # The second backward cannot drop an example: a zero weight times a NaN/inf partial derivative
    # of a dropped example is NaN. Then (and only then) the same clipped sum is taken by
    # book-keeping from the zeroed factors (equal in exact arithmetic).
    two_pass_ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grad_sum)]))
    return jax.lax.cond(two_pass_ok, lambda: grad_sum, bookkeeping)


def _finish(cp: _ClipPlan, part: _Part, losses, contribs, bound, unit_w, keep, unit_bad,
            all_finite=False) -> ClippedGrad:
    """Clip factors from the certified bounds (q, lin) [N, K] of the units (weights unit_w, non-finite unit_bad),
    and the clipped sum of the examples kept (`keep`) by book-keeping (or a second backward). `grad_sum` is float32
    for every leaf, also for bfloat16/float16 parameters: a sum of many units rounded to 8 bits would let one unit
    move it by far more than C_k (docs/clipping.md#mixed-precision)."""
    factors, gnorms, total_norms, num_nonfinite = _clip_factors(cp, bound, unit_w, unit_bad)
    # Per-example weights per group (0 for dropped examples, whose factors are zeros anyway).
    ex_factors = (factors if part.group_ids is None
                  else jnp.where(keep[:, None], factors[part.group_ids], 0.0))   # [B, K]

    def bookkeeping():
        return _bookkeeping_sum(cp, contribs, ex_factors, all_finite)

    if cp.method == "ghost-two-pass":
        grad_sum = _two_pass_sum(cp, part.batch, ex_factors, bookkeeping)
    else:
        grad_sum = bookkeeping()
    K = cp.num_groups
    return cp.result(grad_sum=grad_sum, norms=total_norms, loss=losses,
                     clip_factors=factors[:, 0] if K == 1 else factors, group_norms=None if K == 1 else gnorms,
                     num_nonfinite=num_nonfinite)


def per_example_grads_reference(loss_fn: Callable, params: Any, batch: Any,
                                matmul_precision: str | None = SUM_PRECISION) -> Any:
    """NON-PRIVATE reference: per-example gradients [B, ...] by vmap(grad) (B x params memory), with
    `clipped_grad`'s default precision (on GPUs TF32 would make the reference the inexact side)."""
    def one(ex):
        return jax.grad(lambda p: jnp.reshape(loss_fn(p, jax.tree.map(lambda x: x[None], ex)), ()))(params)
    if matmul_precision is None:
        return jax.vmap(one)(batch)
    with jax.default_matmul_precision(matmul_precision):
        return jax.vmap(one)(batch)


def explain(loss_fn: Callable, params: Any, batch: Any, method: str = "auto",
            memory_limit: int = DEFAULT_MEMORY_LIMIT, batch_chunk: int | str | None = "auto") -> list[dict]:
    """The tapping plan, as `clipped_grad` would run it on this batch (traced abstractly, nothing runs).

    One row per recognised layer call (layer, method, kind, tapped, params), then a summary row:
      raw_products: parameters read directly in a matrix product outside any layer (`h @ E.T`), tapped there;
      fallback: parameters whose per-example gradients come from the exact vmap fallback;
      fallback_bytes: memory of those per-example gradients (B x their size, float32);
      leaves: per used parameter, how its norm is computed ("ghost", "instantiated", "lookup",
        "fallback"), the working memory in bytes and, for matrix sites, the FLOPs of both norm
        methods that the mixed rule compares (instantiation costs ~GHOST_COST_FACTOR less per FLOP);
        a fallback leaf that could have been tapped inside a scan says why it was not ("why");
      per_example_bytes, batch_chunk: one example's recorded state and the examples per chunk that
        `batch_chunk` gives for this batch (= B: one pass over the whole batch).
    """
    leaves, treedef = jax.tree.flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    B = _batch_size(batch)
    mth = "ghost" if method == "ghost" else "auto"
    out = {}

    def trace(lv, b):
        plan, _, contribs = _factored_grads(loss_fn, lv, treedef, b, method, memory_limit)
        out["plan"] = plan
        out["leaves"] = {i: _norms.describe(c, mth, memory_limit) for i, c in contribs.items()
                         if c.mats or c.lookups or c.insts}
        return jnp.zeros(())

    with jax.default_matmul_precision(SUM_PRECISION):
        jax.eval_shape(trace, leaves, batch)
    plan = out["plan"]
    rows = [{"site": s.index, "layer": s.layer, "method": s.method, "kind": s.kind,
             "tapped": s.index in plan.allowed, "params": [paths[i] for i in s.leaf_ids]} for s in plan.sites]
    described = {}
    for i, d in out["leaves"].items():
        if i in plan.fallback:
            d = {"norm": "fallback", "bytes": 4 * B * int(np.size(leaves[i]))}
            if i in plan.cheaper_whole:
                d["why"] = "read in a scan's matrix products, but its scan's kernels are smaller than what tapping records"
        described[paths[i]] = d
    rows.append({"raw_products": [{"param": paths[r.leaf], "contracted_axis": r.param_axis,
                                   "out_shape": r.out_shape[1:], **({"scan_length": r.length} if r.length else {})}
                                  for r in plan.raw],
                 "fallback": [paths[i] for i in plan.fallback],
                 "fallback_bytes": sum(described[paths[i]]["bytes"] for i in plan.fallback),
                 "per_example_bytes": _taps.per_example_bytes(plan, leaves),
                 "batch_chunk": _chunk_size_of(batch_chunk, loss_fn, plan, leaves, treedef, batch, method,
                                               memory_limit),
                 "leaves": described})
    return rows


__all__ = ["ClippedGrad", "METHODS", "clipped_grad", "explain", "per_example_grads_reference"]
