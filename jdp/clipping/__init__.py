"""Fast exact per-example clipping for Flax models and DP-SGD.

`clipped_grad(loss_fn, params, batch, l2_clip=...)` returns the sum of per-example clipped gradients
using taps on recognised linen layers (ghost / instantiated norms, Phantom clipping for tied
embeddings, exact cross-site terms, book-keeping) and an exact vmap fallback for everything else.
`dp_sgd(...)` wraps it into DP-SGD with Poisson sampling, an optax noise transformation and a
PrivacyReport from dp_accounting. `dp_adam_bc` is Adam for its noisy gradients (the known noise variance
removed from the second moment: `jdp.clipping.optimizers`).
"""
from jdp.clipping.dp_sgd import (DPSGD, DPSGDState, calibrate_noise_multiplier, clipped_accumulate,
                                 default_max_batch_size, dp_aggregate, dp_sgd, dp_sgd_event, poisson_indices,
                                 poisson_sample, with_noise_key, without_noise_key)
from jdp.clipping.engine import METHODS, ClippedGrad, clipped_grad, explain, per_example_grads_reference
from jdp.clipping.optimizers import dp_adam_bc, noise_variance, scale_by_adam_bc

__all__ = ["METHODS", "ClippedGrad", "DPSGD", "DPSGDState", "calibrate_noise_multiplier", "clipped_accumulate",
           "clipped_grad", "default_max_batch_size", "dp_adam_bc", "dp_aggregate", "dp_sgd", "dp_sgd_event",
           "explain", "noise_variance", "per_example_grads_reference", "poisson_indices", "poisson_sample",
           "scale_by_adam_bc", "with_noise_key", "without_noise_key"]
