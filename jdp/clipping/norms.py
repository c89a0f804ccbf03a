"""Per-example gradient norms and clipped sums of one parameter from factored per-example gradients.

A parameter W (viewed as a P x Q matrix) receives per-example gradient U_b = sum of contributions:
  mat     (L [B,T,P], R [B,T,Q]):  U_b += L_b^T R_b      Dense kernel (L = inputs, R = output grads);
                                                          Embed.attend (L = logit grads, R = queries)
  lookup  (ids [B,T], R [B,T,Q]):  U_b += onehot(ids_b)^T R_b   Embed lookup (R = output grads)
  inst    (U [B, P*Q]):            U_b += U                instantiated (bias, LayerNorm, fallback)
Squared norms (Li et al. ghost clipping; DPFormer's Phantom clipping when a lookup and an attend site
share W; cross-site terms are exact, never dropped):
  ||sum_s L_s^T R_s||^2 = sum_{t,u} (L L^T)[t,u] (R R^T)[t,u]   with all mat sites concatenated on T
  ||onehot^T R||^2      = sum_{t,u} [ids_t = ids_u] (R R^T)[t,u]
  cross(lookup, mat)    = sum_{t,u} L[u, ids_t] <R_l[t], R_m[u]>   (the corrected Phantom cross term)
The mat part is either ghosted (O(T^2 (P+Q))) or instantiated (O(T P Q), chunked over the batch to cap
memory), whichever is cheaper ("mixed ghost" rule on cost). Gradients instantiated in one piece are kept and
weighted for the clipped sum (no second O(T P Q) product).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class LeafContribs:
    """Per-example gradient of one parameter leaf in factored form (all arrays lead with B)."""
    shape: tuple[int, ...]
    pq: tuple[int, int] | None = None
    mats: list = dataclasses.field(default_factory=list)      # (L [B,T,P], R [B,T,Q])
    lookups: list = dataclasses.field(default_factory=list)   # (ids [B,T] int, R [B,T,Q])
    insts: list = dataclasses.field(default_factory=list)     # U [B, size]
    # mats[i] -> (x, build) where L = build(x) gathers every value of x and zeros (conv im2col patches of the
    # read inputs, K x larger than x): the finiteness check reads x, dropped rows are zeroed in x and L is
    # rebuilt from it (no K x larger masked copy)
    sources: dict = dataclasses.field(default_factory=dict)
    # arrays [B, ...] read only by the finiteness check: the inputs of a term computed from sanitised copies
    # (a transposed conv mixes examples in one op, so no non-finite value may enter it)
    checks: list = dataclasses.field(default_factory=list)
    # U^T [B, Q, P] of the mats and insts, kept by `sq_norms_diag` when it instantiated them in one piece:
    # `clipped_sum` then weights them (B·P·Q flops) instead of a second GEMM over the factors (B·T·P·Q)
    dense: jax.Array | None = None


def rows_finite(x: jax.Array) -> jax.Array:
    """[B] True where every value of the example's row of x is finite."""
    return jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))


def finite_rows(contribs: dict[int, LeafContribs]) -> jax.Array | bool:
    """[B] True where every factor of the example's gradient (all leaves) is finite."""
    ok = True
    for c in contribs.values():
        for i, (L, R) in enumerate(c.mats):
            # a source x holds exactly the values its patches L hold (besides zeros)
            ok = ok & rows_finite(c.sources[i][0] if i in c.sources else L) & rows_finite(R)
        for _, R in c.lookups:
            ok = ok & rows_finite(R)
        for u in c.insts:
            ok = ok & rows_finite(u)
        for x in c.checks:
            ok = ok & rows_finite(x)
    return ok


def zero_rows(contribs: dict[int, LeafContribs], keep: jax.Array) -> None:
    """Sets every factor of the examples with keep False to exact zeros (`where`, NaN-safe), in place."""
    def z(x):
        return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))

    for c in contribs.values():
        c.mats = [(c.sources[i][1](z(c.sources[i][0])) if i in c.sources else z(L), z(R))
                  for i, (L, R) in enumerate(c.mats)]
        c.sources, c.checks = {}, []
        c.lookups = [(ids, z(R)) for ids, R in c.lookups]
        c.insts = [z(u) for u in c.insts]


def _cat(xs, axis=1):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=axis)


def _gather_cols(L, ids):
    """L [B,Tm,P], ids [B,Tl] -> [B,Tm,Tl] with out[b,u,t] = L[b,u,ids[b,t]]."""
    B, Tm, _ = L.shape
    idx = jnp.broadcast_to(ids[:, None, :], (B, Tm, ids.shape[1]))
    return jnp.take_along_axis(L, idx, axis=2)


# Instantiation runs as a plain GEMM per example and is ~2x more efficient per FLOP than the batched
# T x T Grams of ghost clipping on CPU (measured at T=50, vocab 23,715), hence the factor.
GHOST_COST_FACTOR = 2.0


def instantiation_cheaper(T: int, P: int, Q: int) -> bool:
    """The mixed rule's cost comparison for a P x Q parameter read at T positions per example."""
    return T * P * Q <= GHOST_COST_FACTOR * T * T * (P + Q)


def choose_instantiate(c: LeafContribs, method: str) -> bool:
    """Mixed rule: instantiate the mat part when its cost is below the ghost cost."""
    if not c.mats:
        return False
    if method == "ghost":
        return False
    if c.insts:
        return True  # needed to combine exactly with instantiated terms
    P, Q = c.pq
    return instantiation_cheaper(sum(L.shape[1] for L, _ in c.mats), P, Q)


def describe(c: LeafContribs, method: str, memory_limit: int) -> dict:
    """How the norms of one leaf are computed, with the cost model's numbers (for `explain`)."""
    parts, out = [], {}
    if c.lookups:
        parts.append("lookup")
    P, Q = c.pq if c.pq is not None else (1, int(math.prod(c.shape)))
    B = next(x.shape[0] for x in ([L for L, _ in c.mats] + [R for _, R in c.lookups] + c.insts))
    if c.mats:
        T = sum(L.shape[1] for L, _ in c.mats)
        out["ghost_flops"] = 2 * B * T * T * (P + Q)
        out["instantiate_flops"] = 2 * B * T * P * Q
        inst = choose_instantiate(c, method)
        parts.append("instantiated" if inst else "ghost")
        if not inst:
            out["bytes"] = 2 * 4 * B * T * T
    if c.insts or (c.mats and choose_instantiate(c, method)):
        if not c.mats:
            parts.append("instantiated")
        out["bytes"] = 4 * _chunk_size(B, P, Q, memory_limit) * P * Q
    out["norm"] = " + ".join(parts)
    return out


def _chunk_size(B: int, P: int, Q: int, memory_limit: int) -> int:
    """Examples per chunk of instantiated [P, Q] gradients under memory_limit: a divisor of B when one is at
    least half the limit's count (no padded copy of the factors), else the limit's count."""
    limit = int(max(1, min(B, memory_limit // max(1, 4 * P * Q))))
    divisor = max(d for d in range(1, limit + 1) if B % d == 0)
    return divisor if 2 * divisor >= limit else limit


def lookup_sq_norms(ids: jax.Array, R: jax.Array) -> jax.Array:
    """||onehot(ids_b)^T R_b||^2 per example [B]: rows of R with equal ids summed, then squared.

    Sorting the ids and summing runs of equal ids costs O(T log T + T Q) per example; the equality
    matrix [T, T] it replaces costs O(T^2 Q) and dominates for long lookups (e.g. sampled-softmax
    candidates, T ~ 10^3)."""
    T = ids.shape[1]
    if T * T <= 4 * T * max(1, math.ceil(math.log2(max(T, 2)))):  # tiny T: the dense form is cheaper
        eq = (ids[:, :, None] == ids[:, None, :]).astype(R.dtype)
        return jnp.einsum("btu,btq,buq->b", eq, R, R)

    def one(i, r):
        order = jnp.argsort(i)
        s = i[order]
        seg = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), (s[1:] != s[:-1]).astype(jnp.int32)]))
        sums = jax.ops.segment_sum(r[order], seg, num_segments=T, indices_are_sorted=True)
        return jnp.sum(sums * sums)

    return jax.vmap(one)(ids, R)


# Longest window at which the Gram of factors as recorded (not zeroed) is a plain einsum: with no zeroing
# pass to ride on, the [B,P,T] copy below is extra traffic. In seqrec's DP step (interleaved A/B, 2 Poisson
# samples' chunks of windows 5-20) the einsum up to 32 beat the copy from 9 on: windows 12 / 20 at 1.03 /
# 1.04x the non-private passes against 1.16 / 1.22x (benchmarks/README.md#seqrec).
RAW_GRAM_EINSUM_MAX_T = 32


def _gram(X: jax.Array, zeroed: bool = True) -> jax.Array:
    """Per-example Grams X_b X_bᵀ [B,T,T] of X [B,T,P] (`zeroed`: X was just written by the zeroing of
    dropped rows, which the [B,P,T] copy below rides on; else X is the factor as recorded).

    When P ≫ T (e.g. the logit gradients of a tied output layer, P = vocabulary) the batched GEMM runs
    ~3x faster on CPU from X laid out as [B,P,T] (measured at T = 2..50, P = 23,716: 20–45 ms vs
    68–118 ms); the barrier keeps XLA from folding the transpose back into the dot, so the layout is
    materialised once (fused with the zeroing of dropped rows when that precedes it). Since XLA's CPU dots
    run on YNNPACK (jax 0.10) the plain einsum is faster in isolation up to T ~ 32, but inside seqrec's DP
    step on zeroed factors only at T <= 3: four interleaved A/Bs there, the last over 6 Poisson steps x 3
    rounds, took its length-3 chunks 12-15% and its length-2 chunks 4-5% faster, about 2% of the step
    (benchmarks/README.md#seqrec). On factors as recorded it is the einsum up to RAW_GRAM_EINSUM_MAX_T."""
    T, P = X.shape[1], X.shape[2]
    if T <= 3 or P <= 4 * T or (not zeroed and T <= RAW_GRAM_EINSUM_MAX_T):  # (P ≤ 4T: no gain from the layout)
        return jnp.einsum("btp,bup->btu", X, X)
    Xt = jax.lax.optimization_barrier(jnp.swapaxes(X, 1, 2))
    return jnp.einsum("bpt,bpu->btu", Xt, Xt)


def sq_norms_diag(c: LeafContribs, method: str, memory_limit: int, zeroed: bool = True) -> jax.Array:
    """Per-example squared norms [B] of one leaf's gradient (`zeroed`: see `_gram`).

    Every term is a sum of products of factor values, so a NaN or inf in any factor of an example makes its
    squared norm NaN or inf (0 * inf is NaN too): finite norms prove finite factors (`engine._clip_batch`)."""
    n2 = 0.0
    inst_mat = choose_instantiate(c, method)
    R_l = ids = None
    if c.lookups:
        ids = _cat([i for i, _ in c.lookups])
        R_l = _cat([r for _, r in c.lookups])
        n2 = n2 + lookup_sq_norms(ids, R_l)
    if c.mats and not inst_mat:
        L = _cat([l for l, _ in c.mats])
        R = _cat([r for _, r in c.mats])
        gl, gr = _gram(L, zeroed), _gram(R, zeroed)
        n2 = n2 + jnp.sum(gl * gr, axis=(1, 2))
        if c.lookups:
            cols = _gather_cols(L, ids)                       # [B, Tm, Tl]
            n2 = n2 + 2.0 * jnp.einsum("but,btq,buq->b", cols, R_l, R)
    if inst_mat or c.insts:
        P, Q = c.pq if c.pq is not None else (1, int(math.prod(c.shape)))
        B = (c.mats[0][0] if c.mats else c.insts[0]).shape[0]
        chunk = _chunk_size(B, P, Q, memory_limit)

        def instantiated(mats, insts):
            # U^T [b, Q, P]: with P >= Q (e.g. vocab x dim) the large factor stays the GEMM's
            # right operand in its stored layout (no transposed copy of the logit gradients).
            Ut = 0.0
            for L, R in mats:
                Ut = Ut + jnp.einsum("btq,btp->bqp", R, L)
            for u in insts:
                Ut = Ut + jnp.swapaxes(u.reshape(u.shape[0], P, Q), 1, 2)
            return Ut

        def one(args, Ut=None):
            mats, insts, lk = args
            Ut = instantiated(mats, insts) if Ut is None else Ut
            out = jnp.sum(Ut * Ut, axis=(1, 2))
            if lk is not None:
                lids, lR = lk
                idx = jnp.broadcast_to(lids[:, None, :], (lids.shape[0], Q, lids.shape[1]))
                rows = jnp.take_along_axis(Ut, idx, axis=2)                  # [b, Q, Tl]
                out = out + 2.0 * jnp.einsum("bqt,btq->b", rows, lR)
            return out

        lk = (ids, R_l) if c.lookups else None
        args = (list(c.mats), list(c.insts), lk)
        if chunk >= B:  # in one piece: kept for `clipped_sum`
            Ut = instantiated(c.mats, c.insts)
            if c.mats:
                c.dense = Ut
            n2 = n2 + one(args, Ut)
        else:
            nb = -(-B // chunk)
            pad = nb * chunk - B

            def split(x):
                x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
                return x.reshape((nb, chunk) + x.shape[1:])

            n2 = n2 + jax.lax.map(one, jax.tree.map(split, args)).reshape(-1)[:B]
    return n2


def sq_norms_pairs(c: LeafContribs, method: str) -> jax.Array:
    """Cross-example inner products K[b, c] = <U_b, U_c> [B, B] (for user-level / group clipping)."""
    inst_mat = choose_instantiate(c, method)
    K = 0.0
    R_l = ids = None
    U = None
    if inst_mat or c.insts:
        P, Q = c.pq if c.pq is not None else (1, int(math.prod(c.shape)))
        U = 0.0
        for L, R in c.mats:
            U = U + jnp.einsum("btp,btq->bpq", L, R)
        for u in c.insts:
            U = U + u.reshape(u.shape[0], P, Q)
        K = K + jnp.einsum("bpq,cpq->bc", U, U)
    if c.lookups:
        ids = _cat([i for i, _ in c.lookups])
        R_l = _cat([r for _, r in c.lookups])
        eq = (ids[:, :, None, None] == ids[None, None, :, :]).astype(R_l.dtype)   # [B,T,C,U]
        K = K + jnp.einsum("btcu,btq,cuq->bc", eq, R_l, R_l)
        if U is not None:
            rows = jnp.take(U, ids, axis=1)                     # [C, B, T, Q] = U[c, ids[b,t]]
            x = jnp.einsum("cbtq,btq->bc", rows, R_l)
            K = K + x + x.T
    if c.mats and not inst_mat:
        L = _cat([l for l, _ in c.mats])
        R = _cat([r for _, r in c.mats])
        gl = jnp.einsum("btp,cup->btcu", L, L)
        gr = jnp.einsum("btq,cuq->btcu", R, R)
        K = K + jnp.einsum("btcu,btcu->bc", gl, gr)
        if c.lookups:
            cols = jnp.take(L, ids, axis=2)                     # [C, U, B, T] = L[c, u, ids[b,t]]
            x = jnp.einsum("cubt,btq,cuq->bc", cols, R_l, R)
            K = K + x + x.T
    return K


def clipped_sum(c: LeafContribs, weights: jax.Array, all_finite: bool = False) -> jax.Array:
    """sum_b weights_b U_b, shaped like the leaf (book-keeping: no second backward). `all_finite`: every
    example's squared norm is known to be finite (then so is every entry of an instantiated U_b)."""
    P, Q = c.pq if c.pq is not None else (1, int(math.prod(c.shape)))
    out = jnp.zeros((P, Q), jnp.float32)
    if c.dense is not None:  # the mats and insts instantiated by `sq_norms_diag`
        # a dropped example's product of finite factors may overflow (its norm did): where, not 0 * inf = NaN
        dense = c.dense if all_finite else jnp.where((weights != 0)[:, None, None], c.dense, 0.0)
        out = out + jnp.einsum("b,bqp->pq", weights.astype(dense.dtype), dense)
    for L, R in ([] if c.dense is not None else c.mats):
        # scale the smaller factor (for Embed.attend, L holds the [B,T,vocab] logit gradients) and
        # keep the large one as the GEMM's right operand in its stored layout (3x faster on CPU)
        if P >= Q:
            out = out + jnp.einsum("btq,btp->qp", R * weights[:, None, None].astype(R.dtype), L).T
        else:
            out = out + jnp.einsum("btp,btq->pq", L * weights[:, None, None].astype(L.dtype), R)
    for ids, R in c.lookups:
        wR = (R * weights[:, None, None].astype(R.dtype)).reshape(-1, Q)
        out = out.at[ids.reshape(-1)].add(wR, mode="drop")
    for u in ([] if c.dense is not None else c.insts):
        out = out + jnp.einsum("b,bk->k", weights.astype(u.dtype), u).reshape(P, Q)
    return out.reshape(c.shape)


__all__ = ["LeafContribs", "choose_instantiate", "describe", "finite_rows", "zero_rows", "sq_norms_diag",
           "sq_norms_pairs", "clipped_sum"]
