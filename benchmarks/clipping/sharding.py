"""Data-parallel DP-SGD on 1, 2 and 4 devices: step time and scaling efficiency (`dp_sgd(mesh=)`).

On a CPU the devices are XLA's fake host devices (`--xla_force_host_platform_device_count`), which share the
host's cores: the numbers say what the collectives and the per-device split cost, not what real devices gain.
Each device count's step and the single-device step without a mesh alternate in one process (interleaved repeats).

    PYTHONPATH=. python -m benchmarks.clipping.sharding [--devices 4] [--batch 512] [--reps 7]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    if "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks.common import write_results
    from jdp.clipping import dp_sgd
    from jdp.clipping.sharding import data_mesh

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.relu(nn.Dense(args.width)(x))
            return nn.Dense(10)(x)

    model = MLP()
    B, N = args.batch, 16 * args.batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, 64)).astype(np.float32)
    y = rng.integers(0, 10, B).astype(np.int32)
    params = model.init(jax.random.key(0), x[:1])

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, b["x"]), b["y"])

    counts = [n for n in (1, 2, 4, 8) if n <= len(jax.devices())]
    variants = {"no mesh": None, **{f"{n} devices": data_mesh(n) for n in counts}}
    steps, states = {}, {}
    for name, mesh in variants.items():
        dp = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=N, batch_size=B / 2, l2_clip=1.0, delta=1e-5, steps=100,
                    noise_multiplier=1.0, mesh=mesh, max_batch_size=B)
        steps[name] = dp.step
        states[name] = dp.init(params, jax.random.key(1))
    batch, mask = {"x": x, "y": y}, np.ones(B, bool)
    times = {name: [] for name in variants}
    for rep in range(args.reps + 1):
        for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            t0 = time.perf_counter()
            states[name], _ = steps[name](states[name], batch, mask)
            jax.block_until_ready(states[name])
            if rep:     # the first round compiles
                times[name].append(time.perf_counter() - t0)
    base = float(np.median(times["no mesh"]))
    rows = []
    for name, mesh in variants.items():
        n = 1 if mesh is None else mesh.shape["data"]
        med = float(np.median(times[name]))
        rows.append({"variant": name, "devices": n, "step_seconds": med, "over_no_mesh": med / base,
                     "scaling_efficiency": base / (n * med), "repeats": len(times[name])})
        print(rows[-1], flush=True)
    print(write_results("clipping_sharding", rows, model=f"MLP 3x{args.width}", batch=B,
                        note="fake host devices share the CPU's cores: efficiency here is not a device's"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
