"""Raw products: parameters read directly in a matrix product outside any recognised layer (`h @ E.T`, a decoder's
`z @ W.T`, an RNN cell's kernels inside a top-level `scan`), found in the loss's jaxpr (`raw_matmuls`), and the
evaluation of that jaxpr with a tap added to each such product's output (`_eval_tapped`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.extend.core as jex_core


def _scan_counts(params) -> tuple[int, int]:
    """(constants, carries) among a `scan` equation's inputs: jax < 0.11 names the counts, later versions give
    the input structure as a flat tree (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


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

