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

Here: the call (`clipped_grad`), the loop over chunks of the batch and the two paths of a chunk (norms from the
factors as recorded, or checked: dropped examples zeroed first). The pieces: `inputs` (argument checks), `mixing`
(the refusal of a loss that mixes examples), `factored` (per-example gradients in factored form, per layer kind),
`norms` (certified norms of one leaf), `bookkeeping` (clip factors and the clipped sum); `taps` finds the sites.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jdp.clipping import norms as _norms
from jdp.clipping import taps as _taps
from jdp.clipping.bookkeeping import _diag_sq_norms, _finish, _group_sq_norms
from jdp.clipping.factored import TRANSPOSED_CONV_MIN_POSITIONS, _discover, _factored_grads, lookup_rows  # noqa: F401
from jdp.clipping.inputs import _batch_size, _check_params, _clip_values, _Part, _partition, _units
from jdp.clipping.mixing import MIXING_CHECK_ROWS, _with_aux, check_per_example_loss  # noqa: F401
from jdp.noise import SUM_PRECISION

METHODS = ("auto", "bk", "ghost", "ghost-two-pass", "vmap")
DEFAULT_MEMORY_LIMIT = 32 << 20  # bytes per chunk of instantiated per-example gradients (cache-sized)


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
