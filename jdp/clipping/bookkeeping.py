"""From the factors to the clipped sum: certified per-unit norm bounds per parameter group (per example, or per
group_ids unit from cross-example inner products), the clip factors, and the sum of the clipped gradients by
book-keeping (weights on the factors: no second backward) or, for "ghost-two-pass", by a second backward.
`cp` is the engine's `_ClipPlan` and `part` its `_Part` (`engine.py`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdp.clipping import norms as _norms

if TYPE_CHECKING:  # annotations only (the engine imports this module)
    from jdp.clipping.engine import ClippedGrad, _ClipPlan
    from jdp.clipping.inputs import _Part


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
