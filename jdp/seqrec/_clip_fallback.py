"""Exact per-example clipping by vmap(grad), used until/unless `jdp.clipping.clipped_grad` exists.

Same contract as the engine: clipped_grad(loss_fn, params, batch, *, l2_clip, mask) ->
ClippedGrad(grad_sum = Σ_b c_b ∇ℓ_b with c_b = min(1, C/‖∇ℓ_b‖) (norm over all parameters jointly),
norms [B], loss [B], num_nonfinite). Masked-out examples contribute nothing, and neither does an
example whose loss or gradient norm is not finite (counted in num_nonfinite); both are dropped with
`where`, so their NaNs never reach a sum. Memory is bounded by processing `micro_batch` examples at a
time (lax.scan), each materialising its per-example gradients.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class ClippedGrad(NamedTuple):
    grad_sum: Any
    norms: jax.Array
    loss: jax.Array
    num_nonfinite: Any = 0


def clipped_grad(loss_fn: Callable, params: Any, batch: dict, *, l2_clip: float, mask: jax.Array | None = None,
                 method: str = "auto", micro_batch: int | None = None, normalize: bool = False) -> ClippedGrad:
    """Sum of per-example clipped gradients (exact, by vmap over examples); normalize: g·C/‖g‖."""
    del method
    B = jax.tree_util.tree_leaves(batch)[0].shape[0]
    keep_mask = jnp.ones((B,), bool) if mask is None else jnp.asarray(mask) != 0   # 0/1 indicator
    mb = B if micro_batch is None else min(int(micro_batch), B)
    if B % mb:
        raise ValueError(f"batch size {B} must be a multiple of micro_batch {mb}")

    def one(p, ex):
        ex1 = jax.tree_util.tree_map(lambda a: a[None], ex)
        return loss_fn(p, ex1)[0]

    per_ex = jax.vmap(jax.value_and_grad(one), in_axes=(None, 0))

    def chunk(acc, xs):
        ex, m = xs
        loss, g = per_ex(params, ex)
        sq = sum(jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim))) for x in jax.tree_util.tree_leaves(g))
        norm = jnp.sqrt(sq)
        ok = jnp.isfinite(loss) & jnp.isfinite(norm)
        keep = m & ok
        c = l2_clip / jnp.maximum(jnp.where(keep, norm, 1.0), 1e-12)
        c = jnp.where(keep, c if normalize else jnp.minimum(1.0, c), 0.0)
        # `where` on the gradients too: 0 * NaN = NaN, a zero factor alone would not drop the example
        acc = jax.tree_util.tree_map(
            lambda a, x: a + jnp.tensordot(c, jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0), axes=1),
            acc, g)
        return acc, (jnp.where(m, norm, 0.0), jnp.where(m, loss, 0.0), jnp.sum(m & ~ok))

    xs = (jax.tree_util.tree_map(lambda a: a.reshape((B // mb, mb) + a.shape[1:]), batch),
          keep_mask.reshape(B // mb, mb))
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    total, (norms, losses, bad) = jax.lax.scan(chunk, zero, xs)
    return ClippedGrad(total, norms.reshape(B), losses.reshape(B), jnp.sum(bad))


def get_clipped_grad() -> Callable:
    """The clipping engine's `clipped_grad` when installed, else this exact fallback."""
    try:
        from jdp.clipping import clipped_grad as engine  # type: ignore[attr-defined]
        return engine
    except ImportError:
        return clipped_grad


__all__ = ["ClippedGrad", "clipped_grad", "get_clipped_grad"]
