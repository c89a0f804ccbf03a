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
import functools
import math
from typing import NamedTuple

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


# ---- floating-point bounds (docs/privacy.md#floating-point) ------------------------------------------------
# Every norm below is a CERTIFIED upper bound on the norm of the vector that `clipped_sum` adds for the unit,
# in float32 as computed. Float model: IEEE binary32, round to nearest, unit roundoff u = 2^-24; a sum of n
# terms formed in ANY order (as XLA's dots and reductions may form it; fused multiply-adds included) is within
# γ_{n-1}·Σ|terms| of the exact sum, γ_n = n·u / (1 - n·u) (Higham, Accuracy and Stability, Lemma 3.1 / 3.4).
# A Gram norm Σ_{t,u} (L Lᵀ)_{tu} (R Rᵀ)_{tu} is a difference of large terms: with ℓ_t = ‖L_t‖, r_t = ‖R_t‖
# and S = Σ_t ℓ_t r_t (≥ ‖Lᵀ R‖ by the triangle inequality), each Gram entry is off by ≤ γ_P ℓ_t ℓ_u (γ_Q r_t r_u)
# and the whole sum by ≤ β S² with β = γ_{P+Q+T+⌈log2 T⌉+4} (the T² terms summed over u in any order, then over t
# by pairwise halving, whose depth XLA cannot change). Sums of non-negative terms (‖U‖² of an instantiated
# gradient, of a lookup's row sums) are taken in blocks of ≤ 32 and then by pairwise halving, so they are off by
# a RELATIVE γ_{32+⌈log2 n⌉+1}. The vector actually summed differs from the exact gradient by ≤ γ_{T+2}·S (its T products
# added by a GEMM or scatter in any order): that LINEAR term is added to the norm outside the square root. A unit
# whose norm is computed as ≈ 0 while its terms are large (near-cancellation) thus gets a norm ≥ √β·S, and its
# summed vector, ≤ ‖exact‖ + γ S, stays within the clip bound.
U32 = 2.0 ** -24
# the roundings of forming the bound itself, besides the sums over leaves (a square root, an addition, the
# products by the constants below): a relative slack above their count times u (`bookkeeping._clip_factors` adds
# γ_leaves)
BOUND_SLACK = 1.0 + 16 * U32
# A product or sum that underflows is flushed to 0 (XLA's CPU backend flushes denormals): an absolute error below
# 2^-126 per operation. In the vector summed (linear in each factor) such errors stay far below ABS_FLOOR for any
# shape that fits in memory. In a squared quantity they do not: a Gram entry of tiny factors (1e-20) flushes to 0
# while the other factor's Gram is huge (1e34), and a unit clipped by the resulting ≈ 0 norm escaped clipping by
# 10^11 (normalize=True). So every sum of n products or squares carries n·FLUSH (FLUSH = 2^-125 ≥ a product's
# and an addition's flush together), multiplied by the largest value it is multiplied with: the other factor's
# largest squared row norm for a Gram, the largest row norm for a cross term. Tests set FLUSH to 0 to reproduce
# the norms before this term.
ABS_FLOOR = 1e-25
FLUSH = 2.0 ** -125
# tests set this to False to reproduce the uncertified norms (the float32 cancellation of audit issue 69 item 1)
_FP_BOUND = True


def gamma(n: int) -> float:
    """Higham's γ_n = n·u / (1 - n·u) for float32 (a static, shape-derived constant)."""
    nu = n * U32
    if nu >= 0.25:
        raise ValueError(f"a float32 sum of {n} terms has no useful error bound: shapes this large are refused")
    return nu / (1.0 - nu)


def _depth(n: int) -> int:
    return max(0, math.ceil(math.log2(max(n, 1))))


def _tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis by pairwise halving (⌈log2 n⌉ additions on every path: an order XLA keeps)."""
    while x.shape[-1] > 1:
        n, h = x.shape[-1], x.shape[-1] // 2
        y = x[..., :h] + x[..., h:2 * h]
        x = y if n % 2 == 0 else jnp.concatenate([y, x[..., 2 * h:]], axis=-1)
    return x[..., 0]


def _block(n: int, most: int = 32) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def sum_nonneg(x: jax.Array) -> tuple[jax.Array, int]:
    """Σ over all but the leading axis of non-negative x [B, ...], and the n of the γ_n bounding its RELATIVE error:
    blocks of ≤ 32 contiguous values summed in any order, then the block sums by pairwise halving."""
    flat = x.reshape(x.shape[0], -1)
    n = flat.shape[1]
    k = _block(n)
    part = jnp.sum(flat.reshape(x.shape[0], n // k, k), axis=2) if k > 1 else flat
    return _tree_sum(part), k + _depth(n // k)


def row_norm_sums(A: jax.Array, B_: jax.Array | None = None) -> tuple[jax.Array, int]:
    """S = Σ_t ‖A_t‖·‖B_t‖ [B] of A [B,T,P], B [B,T,Q] (Σ_t ‖A_t‖ without B), and the n of γ_n with
    S_exact ≤ S·(1 + γ_n)."""
    s = jnp.sqrt(jnp.sum(A * A, axis=-1) + A.shape[-1] * FLUSH)
    n = A.shape[-1] + 3
    if B_ is not None:
        s = s * jnp.sqrt(jnp.sum(B_ * B_, axis=-1) + B_.shape[-1] * FLUSH)
        n += B_.shape[-1] + 3
    return jnp.sum(s, axis=-1), n + A.shape[1]


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


def lookup_sq_norms(ids: jax.Array, R: jax.Array) -> tuple[jax.Array, int]:
    """‖ŝ_b‖² per example [B] with ŝ_b the row sums onehot(ids_b)ᵀ R_b as computed (each off the exact one by
    ≤ γ_T Σ_t |R_t|), and the n of the γ_n bounding the relative error of that sum of squares.

    Sorting the ids and summing runs of equal ids costs O(T log T + T Q) per example; the equality
    matrix [T, T] it replaces costs O(T^2 Q) and dominates for long lookups (e.g. sampled-softmax
    candidates, T ~ 10^3). Both forms square and sum non-negative values only (no cancellation)."""
    T = ids.shape[1]
    if T * T <= 4 * T * max(1, math.ceil(math.log2(max(T, 2)))):  # tiny T: the dense form is cheaper
        eq = (ids[:, :, None] == ids[:, None, :]).astype(R.dtype)
        sums = jnp.einsum("btu,buq->btq", eq, R)           # each position carries its id's row sum
        sq = sums * sums / jnp.sum(eq, axis=2)[..., None]  # ... counted once over the id's positions
        s, n = sum_nonneg(sq)
        return s, n + 3

    def one(i, r):
        order = jnp.argsort(i)
        s = i[order]
        seg = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), (s[1:] != s[:-1]).astype(jnp.int32)]))
        sums = jax.ops.segment_sum(r[order], seg, num_segments=T, indices_are_sorted=True)
        return sums * sums

    s, n = sum_nonneg(jax.vmap(one)(ids, R))
    return s, n + 1


# Longest window at which the Gram of factors as recorded (not zeroed) is a plain einsum: with no zeroing
# pass to ride on, the [B,P,T] copy below is extra traffic. In seqrec's DP step (interleaved A/B, 2 Poisson
# samples' chunks of windows 5-20) the einsum up to 32 beat the copy from 9 on: windows 12 / 20 at 1.03 /
# 1.04x the non-private passes against 1.16 / 1.22x (benchmarks/seqrec/README.md).
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
    (benchmarks/seqrec/README.md). On factors as recorded it is the einsum up to RAW_GRAM_EINSUM_MAX_T."""
    T, P = X.shape[1], X.shape[2]
    if T <= 3 or P <= 4 * T or (not zeroed and T <= RAW_GRAM_EINSUM_MAX_T):  # (P ≤ 4T: no gain from the layout)
        return jnp.einsum("btp,bup->btu", X, X)
    Xt = jax.lax.optimization_barrier(jnp.swapaxes(X, 1, 2))
    return jnp.einsum("bpt,bpu->btu", Xt, Xt)


class _Lookups(NamedTuple):
    """A leaf's lookup sites concatenated over sites, as `sq_norms_diag`'s terms read them."""
    ids: jax.Array      # [B, Tl]
    R: jax.Array        # [B, Tl, Q] output gradients
    S: jax.Array        # [B] ≥ Σ_t ‖R_t‖ (`row_norm_sums`, raised by its γ)
    T: int              # Tl


def _lookup_terms(c: LeafContribs, acc) -> tuple[tuple, _Lookups]:
    """`sq_norms_diag`'s lookup terms added to acc = (n2, err2, lin), and the lookups concatenated."""
    n2, err2, lin = acc
    ids = _cat([i for i, _ in c.lookups])
    R_l = _cat([r for _, r in c.lookups])
    Tl = ids.shape[1]
    s_l, n_l = lookup_sq_norms(ids, R_l)
    S_l, n_s = row_norm_sums(R_l)
    S_l = S_l * (1.0 + gamma(n_s))
    n2 = n2 + s_l
    # flushes: of the row sums' T·Q products and additions (dense form) and of the squares summed
    err2 = err2 + 2.0 * gamma(n_l) * s_l + 2.0 * Tl * R_l.shape[2] * FLUSH
    # the row sums as computed vs exact (segment sums) and the scatter-add of `clipped_sum`: ≤ γ_{T+2} S_l each
    lin = lin + 2.0 * gamma(Tl + 2 + len(c.lookups)) * S_l
    return (n2, err2, lin), _Lookups(ids, R_l, S_l, Tl)


def _ghost_terms(c: LeafContribs, acc, P: int, Q: int, zeroed: bool, lk: _Lookups | None) -> tuple:
    """`sq_norms_diag`'s ghosted mats (all sites concatenated on T, cross-site terms exact) added to
    acc = (n2, err2, lin); with lookups `lk` of the same leaf, the Phantom cross term too."""
    n2, err2, lin = acc
    L = _cat([l for l, _ in c.mats])
    R = _cat([r for _, r in c.mats])
    Tm = L.shape[1]
    gl, gr = _gram(L, zeroed), _gram(R, zeroed)
    n2 = n2 + _tree_sum(jnp.sum(gl * gr, axis=2))
    # S_m from the Grams' diagonals: each ‖L_t‖² is off by a relative γ_P (and P flushes), so ‖L_t‖ by less than γ_P
    dl = jnp.maximum(jnp.diagonal(gl, axis1=1, axis2=2), 0.0) + P * FLUSH
    dr = jnp.maximum(jnp.diagonal(gr, axis1=1, axis2=2), 0.0) + Q * FLUSH
    S_m = jnp.sum(jnp.sqrt(dl) * jnp.sqrt(dr), axis=1)
    S_m = S_m * (1.0 + gamma(P + Q + Tm + 8))
    err2 = err2 + gamma(P + Q + Tm + _depth(Tm) + 4) * S_m * S_m
    # flushes: each Gram entry is off by ≤ P·FLUSH (Q·FLUSH) against the other Gram's entries ≤ its largest
    # diagonal; then the T² products and their sum
    l2, r2 = jnp.max(dl, axis=1) * (1.0 + gamma(P + 2)), jnp.max(dr, axis=1) * (1.0 + gamma(Q + 2))
    err2 = err2 + 2.0 * Tm * Tm * (P * FLUSH * r2 + Q * FLUSH * l2 + 2.0 * FLUSH)   # (FLUSH first: no overflow)
    # book-keeping's GEMM adds the example's Tm products (and a weight, and one add per site): ≤ γ S_m
    lin = lin + gamma(Tm + 2 + len(c.mats)) * S_m
    if lk is not None:
        cols = _gather_cols(L, lk.ids)                               # [B, Tm, Tl] = L[b, u, ids[b, t]]
        M = jnp.einsum("btq,buq->btu", lk.R, R)                      # [B, Tl, Tm], each off by γ_Q
        n2 = n2 + 2.0 * _tree_sum(jnp.sum(jnp.swapaxes(cols, 1, 2) * M, axis=2))
        # |L[u, id]| ≤ ‖L_u‖: off by ≤ γ_{Q+Tm+log Tl+2} S_l S_m; the row sums' own error (≤ γ_T S_l against
        # ‖U_m‖ ≤ S_m) enters the cross term of the computed sums: 2 (β + γ_T) S_l S_m; flushes: M's entries
        # (≤ Q·FLUSH) against |L[u, id]| ≤ √l2, and the Tl·Tm products and their sum
        err2 = err2 + 2.0 * (gamma(Q + Tm + _depth(lk.T) + 3) + gamma(lk.T + 1)) * lk.S * S_m
        err2 = err2 + 4.0 * lk.T * Tm * (Q * FLUSH * jnp.sqrt(l2) + 2.0 * FLUSH)
    return n2, err2, lin


def _instantiate(mats, insts, P: int, Q: int):
    """Uᵀ [b, Q, P] of the mats and insts: with P >= Q (e.g. vocab x dim) the large factor stays the GEMM's
    right operand in its stored layout (no transposed copy of the logit gradients)."""
    Ut = 0.0
    for L, R in mats:
        Ut = Ut + jnp.einsum("btq,btp->bqp", R, L)
    for u in insts:
        Ut = Ut + jnp.swapaxes(u.reshape(u.shape[0], P, Q), 1, 2)
    return Ut


def _inst_sq_and_cross(args, P: int, Q: int, Ut=None) -> tuple[jax.Array, jax.Array]:
    """(‖U_b‖² as computed, the Phantom cross term 2 Σ_t ⟨U_b[ids_t], R_t⟩, or 0 without lookups) [b] of
    args = (mats, insts, (ids, R) of the lookups or None), from Uᵀ when given (else formed here)."""
    mats, insts, lk = args
    Ut = _instantiate(mats, insts, P, Q) if Ut is None else Ut
    sq, _ = sum_nonneg(Ut * Ut)
    cross = jnp.zeros_like(sq)
    if lk is not None:
        lids, lR = lk
        idx = jnp.broadcast_to(lids[:, None, :], (lids.shape[0], Q, lids.shape[1]))
        rows = jnp.take_along_axis(Ut, idx, axis=2)                  # [b, Q, Tl]
        cross = 2.0 * _tree_sum(jnp.sum(rows * jnp.swapaxes(lR, 1, 2), axis=1))
    return sq, cross


def _chunked_sq_and_cross(args, B: int, chunk: int, P: int, Q: int) -> tuple[jax.Array, jax.Array]:
    """`_inst_sq_and_cross` over chunks of `chunk` examples (`lax.map`, the last one zero-padded): [B] each."""
    nb = -(-B // chunk)
    pad = nb * chunk - B

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((nb, chunk) + x.shape[1:])

    one = functools.partial(_inst_sq_and_cross, P=P, Q=Q)
    return jax.tree.map(lambda x: x.reshape(-1)[:B], jax.lax.map(one, jax.tree.map(split, args)))


def _mats_row_norm_sums(c: LeafContribs, B: int) -> tuple[jax.Array, int]:
    """(Σ over the mats of S = Σ_t ‖L_t‖·‖R_t‖ [B], the largest n of their γ_n) (`row_norm_sums`)."""
    S_m, n_s = jnp.zeros((B,), jnp.float32), 0
    for L, R in c.mats:
        s, n = row_norm_sums(L, R)
        S_m, n_s = S_m + s, max(n_s, n)
    return S_m, n_s


def _instantiated_terms(c: LeafContribs, acc, B: int, P: int, Q: int, memory_limit: int,
                        lk: _Lookups | None) -> tuple:
    """`sq_norms_diag`'s instantiated part (the mats when the mixed rule instantiates them, and the insts) added to
    acc = (n2, err2, lin): U formed in chunks under memory_limit (in one piece it is kept in `c.dense` for
    `clipped_sum`); with lookups `lk` of the same leaf, the Phantom cross term against U."""
    n2, err2, lin = acc
    chunk = _chunk_size(B, P, Q, memory_limit)
    args = (list(c.mats), list(c.insts), None if lk is None else (lk.ids, lk.R))
    n_sq = _block(P * Q) + _depth(P * Q // _block(P * Q)) + 1
    if chunk >= B:  # in one piece: kept for `clipped_sum`, which then adds exactly this U
        Ut = _instantiate(c.mats, c.insts, P, Q)
        if c.mats:
            c.dense = Ut
        sq, cross = _inst_sq_and_cross(args, P, Q, Ut)
    else:
        sq, cross = _chunked_sq_and_cross(args, B, chunk, P, Q)
        if c.mats:
            # the norm is of U as formed here, the sum is book-keeping's GEMM over the factors: both within
            # γ_{T+2} S_m of the exact gradient (S_m from the factors' rows: one more pass over them)
            S_m, n_s = _mats_row_norm_sums(c, B)
            Tm = sum(L.shape[1] for L, _ in c.mats)
            lin = lin + 2.0 * gamma(Tm + 2 + len(c.mats)) * S_m * (1.0 + gamma(n_s + len(c.mats)))
    n2 = n2 + sq + cross
    err2 = err2 + gamma(n_sq) * sq + 2.0 * P * Q * FLUSH          # flushes of the P·Q squares and their sum
    if lk is not None:
        # the cross term: off by ≤ γ_{Q+log Tl+2} ‖U‖ S_l, and the row sums' error (≤ γ_T S_l) against ‖U‖;
        # flushes of its Tl·Q products and their sum
        norm_u = jnp.sqrt(sq * (1.0 + gamma(n_sq)) + 2.0 * P * Q * FLUSH)
        err2 = err2 + 2.0 * (gamma(Q + _depth(lk.T) + 3) + gamma(lk.T + 1)) * norm_u * lk.S
        err2 = err2 + 4.0 * lk.T * Q * FLUSH
    return n2, err2, lin


def sq_norms_diag(c: LeafContribs, method: str, memory_limit: int, zeroed: bool = True
                  ) -> tuple[jax.Array, jax.Array]:
    """Certified bounds (q [B], lin [B]) on one leaf's per-example gradient: the vector `clipped_sum` adds for
    example b (weight 1) has norm ≤ √q_b + lin_b (see the floating-point notes above; `zeroed`: see `_gram`).
    Its terms, each with its error bound: `_lookup_terms`, `_ghost_terms`, `_instantiated_terms`.

    Every term is a sum of products of factor values, so a NaN or inf in any factor of an example makes its
    q (or lin) NaN or inf (0 * inf is NaN too): finite bounds prove finite factors (`engine._clip_batch`)."""
    B = next(x.shape[0] for x in ([L for L, _ in c.mats] + [R for _, R in c.lookups] + c.insts))
    zero = jnp.zeros((B,), jnp.float32)
    acc = (zero, zero, zero)          # (computed ‖·‖², its absolute error bound, linear terms)
    inst_mat = choose_instantiate(c, method)
    P, Q = c.pq if c.pq is not None else (1, int(math.prod(c.shape)))
    lk = None
    if c.lookups:
        acc, lk = _lookup_terms(c, acc)
    if c.mats and not inst_mat:
        acc = _ghost_terms(c, acc, P, Q, zeroed, lk)
    if inst_mat or c.insts:
        acc = _instantiated_terms(c, acc, B, P, Q, memory_limit, lk)
    n2, err2, lin = acc
    if not _FP_BOUND:   # the uncertified norm, for tests of the attack this bound defeats
        return n2, zero
    return jnp.maximum(n2, 0.0) + err2, lin


def sq_norms_pairs(c: LeafContribs, method: str) -> tuple[jax.Array, jax.Array, float, jax.Array]:
    """Cross-example inner products for user-level (group) clipping, with their floating-point bounds:
    (K [B, B] with K[b, c] ≈ <U_b, U_c>, S [B], β, lin [B]) such that for any unit n (a set of examples)
    ‖Σ_{b∈n} U_b‖² ≤ Σ_{b,c∈n} K[b, c] + β (Σ_{b∈n} S_b)², and the vector `clipped_sum` adds for the unit is
    within Σ_{b∈n} lin_b of Σ_{b∈n} U_b. Flushes (FLUSH) of a pair's entry are bounded by a product e_b·e_c, and
    Σ_{b,c} e_b e_c = (Σ_b e_b)² is folded into the β term as S_b + e_b/√β."""
    inst_mat = choose_instantiate(c, method)
    B = next(x.shape[0] for x in ([L for L, _ in c.mats] + [R for _, R in c.lookups] + c.insts))
    K, S, lin, beta = 0.0, jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.float32), 0.0
    e = jnp.full((B,), 2.0 ** -63, jnp.float32)   # flushes of a unit's row of K summed: ≤ |n|·2^-126 ≤ (Σ 2^-63)²
    R_l = ids = U = None
    P, Q = c.pq if c.pq is not None else (1, int(math.prod(c.shape)))
    T_all = sum(L.shape[1] for L, _ in c.mats)
    if c.mats:
        # book-keeping's GEMM adds a unit's products (at most B·T of them) in any order
        S_m, n_s = _mats_row_norm_sums(c, B)
        S_m = S_m * (1.0 + gamma(n_s + len(c.mats)))
        lin = lin + gamma(B * T_all + 2 + len(c.mats)) * S_m
    if inst_mat or c.insts:
        U = 0.0
        for L, R in c.mats:
            U = U + jnp.einsum("btp,btq->bpq", L, R)
        for u in c.insts:
            U = U + u.reshape(u.shape[0], P, Q)
        # contracted over the shorter axis, the longer by pairwise halving: each entry off by ≤ β ‖U_b‖ ‖U_c‖
        Kx = jnp.einsum("bpq,cpq->bcq", U, U) if P <= Q else jnp.einsum("bpq,cpq->bcp", U, U)
        K = K + _tree_sum(Kx)
        b_i = gamma(min(P, Q) + _depth(max(P, Q)) + 2)
        S = S + jnp.sqrt(jnp.maximum(jnp.diagonal(K), 0.0) * (1.0 + 2.0 * b_i) + 2.0 * P * Q * FLUSH)  # ≥ ‖U_b‖
        beta = max(beta, b_i)
        e = e + math.sqrt(2.0 * P * Q * FLUSH)                 # a pair's P·Q products and sums
        if c.mats:   # U as formed vs the exact gradient: ≤ γ_{T+1} S_m
            lin = lin + gamma(T_all + 2) * S_m
    if c.lookups:
        ids = _cat([i for i, _ in c.lookups])
        R_l = _cat([r for _, r in c.lookups])
        Tl = ids.shape[1]
        S_l, n_s = row_norm_sums(R_l)
        S = S + S_l * (1.0 + gamma(n_s))
        eq = ids[:, :, None, None] == ids[None, None, :, :]                     # [B,T,C,U]
        RR = jnp.einsum("btq,cuq->btcu", R_l, R_l)
        K = K + jnp.sum(jnp.where(eq, RR, 0.0), axis=(1, 3))
        beta = max(beta, gamma(Q + Tl * Tl + 2))
        e = e + Tl * math.sqrt((Q + 1) * FLUSH)                # RR's entries and their sum
        lin = lin + gamma(B * Tl + 2 + len(c.lookups)) * S_l * (1.0 + gamma(n_s))   # the scatter-add
        if U is not None:
            rows = jnp.take(U, ids, axis=1)                     # [C, B, T, Q] = U[c, ids[b,t]]
            x = jnp.einsum("cbtq,btq->bc", rows, R_l)
            K = K + x + x.T
            beta = max(beta, gamma(Tl * Q + 2))
            e = e + math.sqrt(2.0 * Tl * Q * FLUSH)
    if c.mats and not inst_mat:
        L = _cat([l for l, _ in c.mats])
        R = _cat([r for _, r in c.mats])
        gl = jnp.einsum("btp,cup->btcu", L, L)
        gr = jnp.einsum("btq,cuq->btcu", R, R)
        K = K + jnp.sum(gl * gr, axis=(1, 3))
        S = S + S_m
        beta = max(beta, gamma(P + Q + T_all * T_all + 2))
        # a Gram entry's flushes (≤ P·FLUSH) against the other Gram's entries (≤ the largest row norms' product)
        lmax = jnp.sqrt(jnp.max(jnp.sum(L * L, axis=2), axis=1) * (1.0 + gamma(P + 2)) + P * FLUSH)
        rmax = jnp.sqrt(jnp.max(jnp.sum(R * R, axis=2), axis=1) * (1.0 + gamma(Q + 2)) + Q * FLUSH)
        e = e + T_all * math.sqrt(FLUSH) * (math.sqrt(P) * rmax + math.sqrt(Q) * lmax + 2.0)
        if c.lookups:
            cols = jnp.take(L, ids, axis=2)                     # [C, U, B, T] = L[c, u, ids[b,t]]
            M = jnp.einsum("btq,cuq->btcu", R_l, R)
            x = jnp.einsum("cubt,btcu->bc", cols, M)
            K = K + x + x.T
            beta = max(beta, gamma(Q + T_all * Tl + 2))
            e = e + math.sqrt(2.0 * T_all * Tl * FLUSH) * (Q * lmax + 1.0)   # M's flushes against |L| ≤ lmax
    if not _FP_BOUND:
        return K, jnp.zeros((B,), jnp.float32), 0.0, jnp.zeros((B,), jnp.float32)
    if FLUSH > 0:
        S = S + e / math.sqrt(beta)
    return K, S, beta, lin


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
           "sq_norms_pairs", "clipped_sum", "gamma", "sum_nonneg",
           "BOUND_SLACK", "ABS_FLOOR", "FLUSH"]
