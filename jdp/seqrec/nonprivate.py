"""The NON-PRIVATE reference step of `jdp.seqrec.train` (`epsilon=None`): unclipped gradient sums and no noise,
with the private step's sampling, schedule and optimiser (`nonprivate_step`, the twin of `DPSGD.accumulate` /
`apply`)."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp.clipping.engine import split_into_chunks

# positions per pass of the non-private step on CPU (`nonprivate_chunk`): Amazon Games, Transformer, a step's
# 8 physical chunks of 1024 positions (2-core CPU, one process): 2.8-3.0 s in one pass per chunk, 1.9-2.2 s in
# passes of 64-256 positions (the [rows, 23716] logits and softmax of 128 rows, 12 MB, are read and written
# several times per pass)
NONPRIVATE_CPU_ROWS = 128


class PlainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array


def nonprivate_chunk(batch_chunk, B: int, L: int) -> int:
    """Users per pass of the non-private step: `batch_chunk` as in `jdp.clipping` (None: the whole physical
    chunk); "auto" on CPU: about NONPRIVATE_CPU_ROWS positions, so a pass's [rows, M+1] logits and softmax stay
    in cache instead of streaming through memory several times (elsewhere: the whole chunk)."""
    if batch_chunk is None:
        return B
    if batch_chunk == "auto":
        return B if jax.default_backend() != "cpu" else min(B, max(1, NONPRIVATE_CPU_ROWS // L))
    return min(B, int(batch_chunk))


def nonprivate_step(loss_fn, opt, params, batch_size: float, batch_chunk: int | str | None = "auto"):
    """NON-PRIVATE reference twin of DPSGD.accumulate / apply: unclipped gradient sums, no noise, divided
    by the expected batch size like the private step. Each physical chunk runs as a loop over passes of
    `nonprivate_chunk` users (the private engine's `batch_chunk`), the gradient sum in the loop's carry."""
    tx = optax.chain(optax.scale(1.0 / batch_size), opt)

    def grad_sum(params, batch, keep, aux):
        return jax.value_and_grad(lambda p: jnp.sum(jnp.where(keep, loss_fn(p, batch, aux), 0.0)))(params)

    @jax.jit
    def accumulate(params, acc, batch, mask, aux=None):
        keep = jnp.asarray(mask)
        B, L = batch["input"].shape
        chunk = nonprivate_chunk(batch_chunk, B, L)
        if chunk >= B:
            loss, g = grad_sum(params, batch, keep, aux)
        else:
            def one(carry, part):
                l, g = grad_sum(params, *part, aux)
                return (carry[0] + l, jax.tree_util.tree_map(jnp.add, carry[1], g)), None
            (loss, g), _ = jax.lax.scan(one, (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, params)),
                                        split_into_chunks(batch, keep, chunk))
        sums = {"loss_sum": loss, "count": jnp.sum(keep), "num_nonfinite": jnp.int32(0)}
        return jax.tree_util.tree_map(jnp.add, acc, g), sums

    @jax.jit
    def apply(state, acc):
        upd, opt_state = tx.update(acc, state.opt_state, state.params)
        return PlainState(optax.apply_updates(state.params, upd), opt_state, state.step + 1)

    return PlainState(params, tx.init(params), jnp.zeros((), jnp.int32)), accumulate, apply


__all__ = ["NONPRIVATE_CPU_ROWS", "PlainState", "nonprivate_chunk", "nonprivate_step"]
