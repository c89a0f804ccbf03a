"""The factored per-example gradients of every parameter leaf: the loss run one example at a time with taps
(`taps.run_per_example`), each tapped site's recorded inputs and output gradients turned into the factors that
`norms` takes (`norms.LeafContribs`: products L_bᵀR_b, embedding lookups, instantiated gradients), per layer kind
(Dense, Conv, Embed lookup and attend, other recognised layers), for the raw products and the fallback leaves."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdp.clipping import norms as _norms
from jdp.clipping import taps as _taps
from jdp.clipping.inputs import _batch_size

# Output positions from which an instantiated conv takes its per-example kernel gradients from the layer's own
# transposed convolution instead of im2col patches: measured inside a DP step on CPU (ResNet-18/4 at B = 128,
# MNIST CNN at B = 256), it is as fast as the patch GEMM at 32x32 and 16x16 outputs and needs no patches
# (DP temp memory 863 -> 262 MiB), but slower at 14x14 and below, where the patches are small anyway
TRANSPOSED_CONV_MIN_POSITIONS = 256


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
