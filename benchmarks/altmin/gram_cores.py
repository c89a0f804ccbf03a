"""How many CPU cores the item Gram's batched matmul uses, and what that caps its share of the dense rate at.

The Gram build (`jdp.multitask.gram.class_gram`) is one batched matmul einsum('nld,nle->nde') per length
class on d + 1 = 65 features. This script measures that matmul ALONE (inputs already gathered) at a few class
lengths, as a share of the dense-matmul rate of the SAME process, in three settings, each in a fresh process:

- `all-cores`: as jdp runs by default (one CPU device, every core of the host available);
- `one-core`: the process pinned to one core (`os.sched_setaffinity` before JAX starts), so the dense rate is
  one core's; if the batched matmul's share rises to ~1 here while it is ~1/cores above, XLA runs it on one core;
- `two-devices`: two host-platform CPU devices (`--xla_force_host_platform_device_count=2`), the classes split
  between them with `jax.shard_map` (how jdp's item update shards: one mesh axis over tasks).

Then the whole Gram build of the item update at ML-20M size (as `benchmarks.altmin.speed`), items dealt to as
many shards as devices, and on one device the same matmuls on rows gathered beforehand: the difference is the
cost of gathering (and weighting) the users' rows.

    PYTHONPATH=. python -m benchmarks.altmin.gram_cores            # ~5 min on 2 cores
    PYTHONPATH=. python -m benchmarks.altmin.gram_cores --quick    # the batched matmuls only
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SETTINGS = ("all-cores", "one-core", "two-devices")
LENGTHS = (96, 384, 1024, 8192)  # rows per task (padded class length); the ML-20M-scale plan spans 48..196608
FEATURES = 65                    # d = 64 factors + the constant feature
ROWS = 65536                     # rows per call, as gram.ROWS_PER_BATCH


def measure(setting: str, quick: bool = False) -> dict:
    """Runs in the child process: dense rate and the batched matmul's share of it, per class length."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def timed(fn, *args, repeats=10):  # lower quartile of steady calls: robust to a noisy host
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 4]

    n = 4096
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    dense = 2 * n**3 / timed(jax.jit(lambda x: x @ x), a) / 1e9
    gram = lambda x: jnp.einsum("pnld,pnle->pnde", x, x)  # noqa: E731  (p: the shard axis)
    if setting == "two-devices":
        mesh = Mesh(np.asarray(jax.devices()[:2]), ("tasks",))
        fn = jax.jit(jax.shard_map(gram, mesh=mesh, in_specs=PartitionSpec("tasks"), out_specs=PartitionSpec("tasks")))
        place = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("tasks")))  # noqa: E731
    else:
        fn, place = jax.jit(gram), lambda x: x  # noqa: E731
    rows = []
    for length in LENGTHS:
        batch = max(1, ROWS // length)
        x = place(jax.random.normal(jax.random.key(length), (2, batch, length, FEATURES), jnp.float32))
        gflops = 2 * x.size * FEATURES / timed(fn, x) / 1e9
        rows.append({"rows_per_task": length, "batched_matmul_gflops": gflops, "fraction_of_dense": gflops / dense})
    out = {"setting": setting, "devices": len(jax.devices()), "cpus_usable": len(os.sched_getaffinity(0)),
           "dense_matmul_gflops": dense, "classes": rows}
    if not quick:
        out.update(gram_build(setting, dense, timed))
    return out


def gram_build(setting: str, dense: float, timed) -> dict:
    """The whole Gram build (gather, weighting, batched matmuls) of the item update at ML-20M size, d = 64, as
    benchmarks.altmin.speed measures it, with the items dealt to as many shards as there are devices."""
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jdp.data import planted_powerlaw
    from jdp.multitask import gram
    from jdp.multitask.ssp import task_mesh

    data = planted_powerlaw(seed=0, n_users=136_677, n_items=20_108, nnz=10_000_000).data
    d = FEATURES - 1
    u = jax.random.normal(jax.random.key(1), (data.n_users, d)) / math.sqrt(d)
    feats = jnp.concatenate([u, jnp.ones((data.n_users, 1))], axis=1)
    shards = 2 if setting == "two-devices" else 1
    plan = gram.build_plan(data.item, data.user, None, data.n_items, n_shards=shards)
    classes, _ = gram.device_arrays(plan, plan.slot_values(np.clip(data.rating - 3.5, -2.25, 2.25)))
    if shards == 1:
        one = tuple((s[0], w[0], y[0]) for s, w, y in classes)
        fn, args = jax.jit(lambda f: [gram.class_gram(f, *c) for c in one]), (feats,)
    else:
        spec = PartitionSpec("tasks")
        mesh = task_mesh(shards)
        body = lambda f, cls: [gram.class_gram(f, s[0], w[0], y[0]) for s, w, y in cls]  # noqa: E731
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(), tuple((spec,) * 3 for _ in classes)),
                                   out_specs=spec, check_vma=False))
        args = (jax.device_put(feats, NamedSharding(mesh, PartitionSpec())),
                jax.device_put(classes, NamedSharding(mesh, spec)))
    seconds = timed(fn, *args, repeats=5)
    useful = 2 * data.nnz * FEATURES**2 / 1e9  # GFLOP, padding excluded
    out = {"gram_build_seconds": seconds, "gram_build_fraction_of_dense": useful / seconds / dense,
           "padded_rows_per_rating": plan.padded_rows / data.nnz}
    if shards == 1:
        # The same batched matmuls on rows gathered and weighted beforehand (~3 GiB held at once): what the
        # build would take if the gather of user rows cost nothing. The rest of the build is that gather (and b's
        # matrix-vector products, 1/65 of the flops).
        gathered = [jax.block_until_ready(feats[s] * w[..., None]) for s, w, _ in one]
        matmuls = timed(jax.jit(lambda xs: [jnp.einsum("nld,nle->nde", x, x) for x in xs]), gathered, repeats=5)
        out.update({"matmuls_on_gathered_rows_seconds": matmuls,
                    "matmuls_on_gathered_rows_fraction_of_dense": useful / matmuls / dense,
                    "gather_share_of_build": 1 - matmuls / seconds})
        # Is the gather XLA's weakness or the memory system's? The same random-row gather in numpy.
        rows = np.random.default_rng(0).integers(0, data.n_users, 1 << 19).astype(np.int32)
        xla_s = timed(jax.jit(lambda f, i: f[i]), feats, jnp.asarray(rows), repeats=10)
        table = np.asarray(feats)
        numpy_s = timed(lambda: np.take(table, rows, axis=0), repeats=10)
        out.update({"random_row_gather_mrows_per_s": {"xla": rows.size / xla_s / 1e6,
                                                      "numpy_take": rows.size / numpy_s / 1e6}})
    return out


def child(setting: str, quick: bool) -> None:
    if setting == "one-core":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print(json.dumps(measure(setting, quick)))


def main() -> None:
    import argparse

    from benchmarks.common import write_results
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the batched matmuls only (no ML-20M-size Gram build)")
    quick = ap.parse_args().quick
    results = []
    for setting in SETTINGS:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2" if setting == "two-devices" else ""
        out = subprocess.run([sys.executable, "-m", "benchmarks.altmin.gram_cores", "--child", setting] + ["--quick"] * quick, env=env,
                             capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        results.append(row)
        print(f"{setting:12s} dense {row['dense_matmul_gflops']:6.1f} GFLOP/s  batched matmul, % of dense: " +
              "  ".join(f"L={c['rows_per_task']}: {100 * c['fraction_of_dense']:.0f}%" for c in row["classes"]) +
              (f"; whole Gram build {row['gram_build_seconds']:.2f} s, "
               f"{100 * row['gram_build_fraction_of_dense']:.0f}% of dense" if "gram_build_seconds" in row else "") +
              (f"; its matmuls on pre-gathered rows {row['matmuls_on_gathered_rows_seconds']:.2f} s "
               f"({100 * row['matmuls_on_gathered_rows_fraction_of_dense']:.0f}% of dense)"
               if "matmuls_on_gathered_rows_seconds" in row else ""))
    name = "altmin_gram_cores" + ("_quick" if quick else "")
    print("wrote", write_results(name, results, features=FEATURES))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        child(sys.argv[2], "--quick" in sys.argv[3:])
    else:
        main()
