"""What float32 matmuls cost in `clipped_grad` (the default `matmul_precision="highest"`), side by side.

On GPUs JAX's default float32 matmuls use TF32; the per-example norms and the clipped sum then round
differently and one example's contribution measured up to 1.00036·C on an H100, so the engine traces
its matmuls at "highest" by default. This times one clipped gradient of the DPFormer-size model at
"highest", at the caller's default (`matmul_precision=None`) and the non-private gradient, interleaved
(medians of 5). On a CPU the two precisions are the same computation.

    PYTHONPATH=. python -m benchmarks.clipping.precision
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import jdp.clipping as jc
from benchmarks.clipping.bench import DPFormerSize, make_batch, make_loss
from benchmarks.common import write_results

CONFIGS = [(3416, 256, 50), (23715, 256, 50), (3416, 1024, 200)]


def run_config(vocab: int, batch_size: int, length: int, reps: int = 5) -> dict:
    model = DPFormerSize(vocab=vocab, max_len=length)
    batch = make_batch(jax.random.key(0), batch_size, length, vocab)
    params = model.init(jax.random.key(1), batch["seq"][:1])["params"]
    loss_fn = make_loss(model)
    mask = jnp.ones((batch_size,), jnp.float32)
    fns = {
        "nonprivate": jax.jit(lambda p, b: jax.grad(lambda q: jnp.sum(loss_fn(q, b)))(p)),
        "clipped-highest": jax.jit(lambda p, b: jc.clipped_grad(loss_fn, p, b, l2_clip=1.0, mask=mask).grad_sum),
        "clipped-default": jax.jit(lambda p, b: jc.clipped_grad(loss_fn, p, b, l2_clip=1.0, mask=mask,
                                                                 matmul_precision=None).grad_sum),
    }
    for f in fns.values():
        jax.block_until_ready(f(params, batch))
    times = {name: [] for name in fns}
    for _ in range(reps):  # interleaved: ratios are taken under the same load
        for name, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(params, batch))
            times[name].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"vocab": vocab, "batch": batch_size, "length": length, "median_seconds": med,
            "highest_over_default": med["clipped-highest"] / med["clipped-default"],
            "highest_over_nonprivate": med["clipped-highest"] / med["nonprivate"],
            "default_over_nonprivate": med["clipped-default"] / med["nonprivate"]}


def main() -> None:
    rows = []
    for cfg in CONFIGS:
        rows.append(run_config(*cfg))
        print(rows[-1], flush=True)
    print("wrote", write_results("clipping_precision", rows))


if __name__ == "__main__":
    main()
