"""The refusal of a loss that mixes the examples of its batch (`check_per_example_loss`), decided on public synthetic
inputs before any private value is used."""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def _with_aux(loss_fn, aux, params, batch):
    """`clipped_grad`'s loss with `aux` bound (as functools.partial(_with_aux, loss_fn, aux)): the check unwraps it."""
    return loss_fn(params, batch, aux)


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
