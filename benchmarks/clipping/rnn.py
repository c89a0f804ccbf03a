"""RNN cells under nn.RNN: the kernels tapped inside the scan vs sent to the vmap fallback, side by side.

    PYTHONPATH=. python -m benchmarks.clipping.rnn

Each configuration (cell, hidden, input features, steps, batch) runs non-private, `auto` (jdp's per-scan choice),
forced tapping and forced fallback, each variant in its own process (jit caches do not mix); median of 5 steps
after compilation, XLA's compiled memory. Writes benchmarks/clipping/results/clipping_rnn.json.
"""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import write_results

CONFIGS = [("optimized-lstm", 64, 64, 50, 256), ("lstm", 64, 64, 50, 256), ("lstm", 128, 64, 50, 256),
           ("lstm", 512, 256, 8, 64)]
VARIANTS = ("nonprivate", "auto", "tapped", "fallback")

CHILD = r"""
import json, sys, time
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
import jdp.clipping as jc
from jdp.clipping import taps
variant, cell, H, D, T, B = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
if variant == "tapped":
    taps._scan_leaves_cheaper_whole = lambda raw, leaves: set()
if variant == "fallback":
    taps._scan_leaves_cheaper_whole = lambda raw, leaves: {r.leaf for _, r in raw if r.length}
class M(nn.Module):
    @nn.compact
    def __call__(self, ids):
        c = {"lstm": nn.LSTMCell, "optimized-lstm": nn.OptimizedLSTMCell}[cell](H)
        return nn.Dense(2)(nn.RNN(c)(nn.Embed(1000, D)(ids))[:, -1])
m = M()
batch = {"x": jax.random.randint(jax.random.key(0), (B, T), 0, 1000), "y": jnp.arange(B) % 2}
params = m.init(jax.random.key(1), batch["x"][:1])["params"]
def loss(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(m.apply({"params": p}, b["x"]), b["y"])
f = jax.jit(jax.grad(lambda p, b: loss(p, b).sum()) if variant == "nonprivate"
            else lambda p, b: jc.clipped_grad(loss, p, b, l2_clip=1.0).grad_sum)
mem = f.lower(params, batch).compile().memory_analysis()
jax.block_until_ready(f(params, batch))
ts = []
for _ in range(5):
    t = time.perf_counter(); jax.block_until_ready(f(params, batch)); ts.append(time.perf_counter() - t)
tapped = [] if variant == "nonprivate" else [r["param"] for r in jc.explain(loss, params, batch)[-1]["raw_products"]]
print(json.dumps({"step_seconds": float(np.median(ts)), "tapped_kernels": len(tapped),
                  "compiled_bytes": int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)}))
"""


def main() -> None:
    rows = []
    for cell, H, D, T, B in CONFIGS:
        base = None
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, "-c", CHILD, variant, cell, str(H), str(D), str(T), str(B)],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = {"cell": cell, "hidden": H, "features": D, "steps": T, "batch": B, "variant": variant, **json.loads(out)}
            base = r if variant == "nonprivate" else base
            r["time_over_nonprivate"] = r["step_seconds"] / base["step_seconds"]
            r["memory_over_nonprivate"] = r["compiled_bytes"] / base["compiled_bytes"]
            rows.append(r)
            print(f"{cell} H={H} D={D} T={T} B={B} {variant:10s} {r['step_seconds']:.4f} s  "
                  f"{r['time_over_nonprivate']:.2f}x time  {r['memory_over_nonprivate']:.2f}x memory  "
                  f"tapped kernels {r['tapped_kernels']}", flush=True)
    print("wrote", write_results("clipping_rnn", rows, command="PYTHONPATH=. python -m benchmarks.clipping.rnn"))


if __name__ == "__main__":
    main()
