"""Fast exact per-example clipping for Flax models and DP-SGD (spec: clipping_dpformer.md §1-4).

`clipped_grad(loss_fn, params, batch, l2_clip=...)` returns the sum of per-example clipped gradients
using taps on recognised linen layers (ghost / instantiated norms, Phantom clipping for tied
embeddings, exact cross-site terms, book-keeping) and an exact vmap fallback for everything else.
"""
from jdp.clipping.engine import METHODS, ClippedGrad, clipped_grad, explain, per_example_grads_reference

__all__ = ["METHODS", "ClippedGrad", "clipped_grad", "explain", "per_example_grads_reference"]
