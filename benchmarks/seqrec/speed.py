"""DPFormer epoch time against the machine's floor (Amazon Games, full softmax over all items).

  PYTHONPATH=. python -m benchmarks.seqrec.speed [--steps 0] [--vmap-steps 3] [--variants ...]

Measured on one machine in one run:
- the floor: the FLOPs of one epoch at the REAL (non-padding) target positions (output layer forward +
  two backward matmuls, 6·n·(M+1)·d, plus the Transformer body, ≈ 36·d² per position per block) divided
  by the measured rate of the output-layer matmul [chunk_rows × d]·[d × (M+1)], plus one exp per position
  and item (the fewest a softmax needs) divided by the measured rate of exp + row sum on the same shape
  (`floor_epoch_s_best_rows`: the same at the best rate of that product in 128 / 256 / 512 rows, a
  stricter floor, reported beside it);
- `nonprivate_epoch_s` (plain gradients), `dp_epoch_s` (DP-SGD with `jdp.clipping`, method auto) and
  `vmap_epoch_s` (the engine's exact vmap reference, a few steps only: it materialises B × params), each
  in its own process (peak RSS), on the same Poisson samples (same key), DPFormer d=64, 2 blocks, 1 head,
  dropout 0.5, batch 1024, the library's default length windows and chunk size;
- `paired_nonprivate_epoch_s` / `paired_dp_epoch_s` (variant `paired`): the same two steps in ONE process,
  alternating step by step on the same samples (`paired`), so that drift between processes cancels; their
  ratio is reported beside the target's (whose epochs each ran in a process of their own);
- `dp_whole_epoch_s` / `nonprivate_whole_epoch_s`: the same DP-SGD / plain gradients with `batch_chunk=None`
  (each physical chunk in one pass instead of the library default "auto": on CPU, passes of a few users;
  variants `dp_whole` / `nonprivate_whole`, not in the default list);
- `dp_sampled_epoch_s`: the same DP-SGD with a sampled softmax (`--negatives` uniform negatives per step,
  beyond the paper; its quality is compared in the seqrec results).
Host memory: glibc's default malloc, as users get it; `--reuse-host-memory` calls
`jdp.hostmem.reuse_freed_memory()` first in every process, floor included (XLA's large buffers then reuse
freed memory instead of faulting in fresh pages on every call). Recorded as `host_malloc`.
Epoch times are steady-state: (mean time of the timed epoch's steps that compiled no new chunk shape) × steps
per epoch, where the timed epoch follows `--warm-epochs` (default 1) untimed ones: a first epoch compiles most
chunk shapes and, in the background, the evaluation (a DP epoch timed after a warm one was no faster, 2026-11-29,
but it leaves compilation out by construction); the first epoch's total including compilation is recorded too. Ratios are within this run; `--rounds R` repeats
the floor and the variants R times in turn (a busy shared host drifts between processes) and the summary
takes each one's median over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import write_results

TARGETS = {"nonprivate_epoch_s / floor_epoch_s": 1.5, "dp_epoch_s / nonprivate_epoch_s": 1.3}
FULL = ["nonprivate", "dp", "paired", "vmap", "dp_sampled"]   # the variants of `seqrec_speed.json`
PAIRED_KEY = "paired_dp_epoch_s / paired_nonprivate_epoch_s"   # the same ratio, both in one process (`paired`)


def _data(path):
    from jdp.seqrec import data as data_mod
    return data_mod.load("amazon-games", path=path)


def _rates(n_items: int, d: int, rows: int) -> dict:
    """Measured matmul FLOP/s and exp/s on the output layer's shape."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (rows, d))
    b = jax.random.normal(jax.random.key(1), (d, n_items + 1))
    mm = jax.jit(lambda a, b: a @ b)
    ex = jax.jit(lambda z: jnp.sum(jnp.exp(z - 3.0), axis=-1))
    z = mm(a, b).block_until_ready()
    ex(z).block_until_ready()

    def best(f, *x, reps=7):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(*x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))
    t_mm, t_exp = best(mm, a, b), best(ex, z)
    return {"matmul_flops_per_s": 2 * rows * d * (n_items + 1) / t_mm, "exp_per_s": rows * (n_items + 1) / t_exp,
            "shape": [rows, d, n_items + 1]}


def floor(data_path: str, d: int = 64, blocks: int = 2) -> dict:
    from jdp.hostmem import reuse_freed_memory_if_requested
    reuse_freed_memory_if_requested()  # --reuse-host-memory (JDP_HOST_MALLOC=reuse), before any JAX work
    from jdp.seqrec.train import TrainConfig
    data = _data(data_path)
    rows = TrainConfig().chunk_rows
    n = int((data.train_target > 0).sum())
    r = _rates(data.n_items, d, rows)
    out_flops = 6.0 * n * (data.n_items + 1) * d
    body_flops = 36.0 * d * d * blocks * n
    exps = float(n) * (data.n_items + 1)
    # the same product in fewer rows: its output fits in cache (and below malloc's mmap threshold), and on a
    # CPU it runs much faster than at `chunk_rows`; the floor at the best of these rates is the stricter one
    by_rows = {str(k): _rates(data.n_items, d, k)["matmul_flops_per_s"] for k in (128, 256, 512) if k < rows}
    best = max([r["matmul_flops_per_s"], *by_rows.values()])
    strict = (out_flops + body_flops) / best + exps / r["exp_per_s"]
    return {**r, "matmul_flops_per_s_by_rows": by_rows, "floor_epoch_s_best_rows": strict, "real_positions": n,
            "n_items": data.n_items, "output_flops": out_flops, "body_flops": body_flops, "exps": exps,
            "floor_matmul_s": (out_flops + body_flops) / r["matmul_flops_per_s"], "floor_exp_s": exps / r["exp_per_s"],
            "floor_epoch_s": (out_flops + body_flops) / r["matmul_flops_per_s"] + exps / r["exp_per_s"]}


def variant(name: str, data_path: str, steps: int, negatives: int = 1024, warm_epochs: int = 1) -> dict:
    """One training variant (run in its own process): per-step times over `steps` steps (0: `warm_epochs`
    epochs, then the timed one)."""
    from jdp.hostmem import reuse_freed_memory_if_requested
    reuse_freed_memory_if_requested()  # inherited JDP_HOST_MALLOC, before any JAX work
    import jax

    from jdp.seqrec.train import TrainConfig, sampling_plan, train
    data = _data(data_path)
    cfg = TrainConfig(model="dpformer", epsilon=None if name.startswith("nonprivate") else 8.0, batch_size=1024,
                      lr=1e-3, dropout=0.5, clipping="vmap" if name == "vmap" else "auto",
                      chunk_rows=256 if name == "vmap" else TrainConfig().chunk_rows,
                      negatives=negatives if name == "dp_sampled" else 0,
                      batch_chunk=None if name.endswith("_whole") else TrainConfig().batch_chunk,
                      item_init="random")  # the paper's start: the timed step is the same either way
    _, _, total = sampling_plan(data, cfg)
    per_epoch = int(np.ceil(data.n_users / cfg.batch_size))
    warm_epochs = warm_epochs if steps <= 0 else 0
    n = per_epoch * (warm_epochs + 1) if steps <= 0 else min(steps, total)
    r = train(data, cfg, jax.random.key(0), progress=False, evaluate_test=False, max_steps=n)
    t = np.array(r.timings["step_s"])
    first = t[:per_epoch].sum() if steps <= 0 else t.sum() * per_epoch / n  # the first epoch, with compilation
    timed = slice(warm_epochs * per_epoch, n)
    t_timed = t[timed]
    compiled_none = np.array(r.timings["step_new_shapes"])[timed] == 0
    steady = float(t_timed[compiled_none].mean()) if compiled_none.any() else float(t_timed.mean())
    return {"variant": name, "clipping": cfg.clipping, "chunk_rows": cfg.chunk_rows, "negatives": cfg.negatives,
            "batch_chunk": cfg.batch_chunk,
            "steps_run": int(n), "warm_epochs": warm_epochs, "steps_timed": int(t_timed.size),
            "steps_per_epoch": per_epoch, "steady_steps": int(compiled_none.sum()), "step_s": t.tolist(),
            "epoch_s": steady * per_epoch, "total_s_with_compile": float(first),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def paired(data_path: str, epochs: int = 1, warm_epochs: int = 1) -> dict:
    """DP-SGD and the non-private reference in ONE process, step by step on the same Poisson samples and
    physical chunks (the order alternating every step), so that a host's drift between processes, which has
    moved DP ÷ non-private by ±0.1 between runs, hits both alike: each variant's epoch is the sum of its
    steady steps (steps that compiled no new chunk shape for either), scaled to the epoch's steps; the
    per-step ratios' median and quartiles are recorded too. Same settings as `variant` (DPFormer, B 1024)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jdp.clipping import dp_sgd
    from jdp.clipping.dp_sgd import poisson_indices
    from jdp.seqrec import reattention as ra
    from jdp.seqrec import train as tr
    from jdp.seqrec.models import make_loss_fn, make_model
    from jdp.seqrec.nonprivate import nonprivate_step
    from jdp.seqrec.prepare import reatt_inputs
    data = _data(data_path)
    cfg = tr.TrainConfig(model="dpformer", epsilon=8.0, batch_size=1024, lr=1e-3, dropout=0.5, item_init="random")
    N, q, steps = tr.sampling_plan(data, cfg)
    L, M = data.maxlen, data.n_items
    key = jax.random.key(0)
    k_init, k_hist, k_train = jax.random.split(key, 3)
    k_noise, k_sample, k_dropout = jax.random.split(k_train, 3)
    _, sigma, counts, _ = tr.privacy_setup(data, cfg, k_hist)
    model = make_model(cfg.model, M, L, cfg.d, cfg.heads, cfg.blocks, cfg.dropout, cfg.activation, cfg.norm,
                       cfg.ffn_dim, cfg.item_dim)
    params = jax.jit(model.init)(k_init, jnp.zeros((1, L), jnp.int32))
    loss_fn = make_loss_fn(model)
    opt = optax.adamw(tr.lr_schedule(cfg.lr, steps, cfg.warmup_frac), weight_decay=cfg.weight_decay)
    dp = dp_sgd(loss_fn, opt, num_examples=N, batch_size=cfg.batch_size, l2_clip=cfg.l2_clip, delta=cfg.delta,
                steps=steps, noise_multiplier=sigma, method=cfg.clipping, normalize=cfg.normalize, unit="user",
                batch_chunk=cfg.batch_chunk)
    np_state, np_acc, np_apply = nonprivate_step(loss_fn, opt, params, cfg.batch_size, cfg.batch_chunk)
    runs = {"nonprivate": [np_state, np_acc, np_apply],
            "dp": [jax.jit(dp.init)(params, jax.random.key_data(k_noise)), dp.accumulate, dp.apply]}
    reatt = reatt_inputs(*ra.effective_variances(sigma, cfg.l2_clip, cfg.batch_size, q, counts, cfg.error_scale))
    windows = np.array(sorted({int(b) for b in cfg.length_buckets if 0 < b < L} | {L}))
    zero = jax.tree.map(jnp.zeros_like, params)
    per_epoch = int(np.ceil(data.n_users / cfg.batch_size))
    times, new_shapes, seen = {v: [] for v in runs}, [], set()
    for step in range((warm_epochs + epochs) * per_epoch):
        idx = poisson_indices(jax.random.fold_in(k_sample, step), N, q)   # the rule of every jdp DP-SGD step
        chunks = tr.step_batches(data, idx[idx < data.n_users], windows, cfg.chunk_rows,
                                 jax.random.fold_in(k_dropout, step))
        shapes = {(w, int(m.size)) for w, _, m in chunks}
        new_shapes.append(len(shapes - seen))
        seen |= shapes
        for name in (list(runs) if step % 2 == 0 else list(runs)[::-1]):
            state, accumulate, apply = runs[name]
            t0 = time.perf_counter()
            acc = zero
            for _, batch, mask in chunks:
                acc, _ = accumulate(state.params, acc, batch, mask, reatt)
            state = jax.block_until_ready(apply(state, acc))
            times[name].append(time.perf_counter() - t0)
            runs[name][0] = state
    timed = slice(warm_epochs * per_epoch, None)
    steady = np.array(new_shapes)[timed] == 0
    t = {v: np.array(times[v])[timed][steady] for v in runs}
    ratio = t["dp"] / t["nonprivate"]
    return {"variant": "paired", "steps_run": len(times["dp"]), "warm_epochs": warm_epochs, "epochs_timed": epochs,
            "steps_per_epoch": per_epoch, "steady_steps": int(steady.sum()),
            "step_s": {v: times[v] for v in runs}, "step_new_shapes": new_shapes,
            "nonprivate_epoch_s": float(t["nonprivate"].mean() * per_epoch), "dp_epoch_s": float(t["dp"].mean() * per_epoch),
            "dp_over_nonprivate_per_step": {"median": float(np.median(ratio)),
                                            "quartiles": [float(x) for x in np.percentile(ratio, [25, 75])]},
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-path", default=None, help="Video.txt (default ../shared/datasets/amazon-games/Video.txt)")
    ap.add_argument("--steps", type=int, default=0, help="steps timed per variant (0: one epoch after the warm ones)")
    ap.add_argument("--warm-epochs", type=int, default=1, help="untimed epochs before the timed one (with --steps 0)")
    ap.add_argument("--vmap-steps", type=int, default=3)
    ap.add_argument("--negatives", type=int, default=1024, help="negatives per step of the dp_sampled variant")
    ap.add_argument("--variants", default=",".join(FULL),
                    help="comma-separated; a subset writes seqrec_speed_<subset>.json instead of seqrec_speed.json")
    ap.add_argument("--reuse-host-memory", action="store_true",
                    help="jdp.hostmem.reuse_freed_memory() in every process, floor included")
    ap.add_argument("--rounds", type=int, default=1, help="floor + variants repeated this many times in turn")
    ap.add_argument("--paired-epochs", type=int, default=1, help="timed epochs of the paired variant")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["JDP_HOST_MALLOC"] = "reuse" if args.reuse_host_memory else "system"  # inherited by the variants
    root = pathlib.Path(__file__).resolve().parents[2]
    path = args.data_path or str(root.parent / "shared" / "datasets" / "amazon-games" / "Video.txt")
    if args.variant:
        row = (paired(path, max(1, args.paired_epochs), args.warm_epochs) if args.variant == "paired" else
               variant(args.variant, path, args.steps, args.negatives, args.warm_epochs))
        print(json.dumps(row))
        return 0
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    floors, runs = [], []
    for rnd in range(max(1, args.rounds)):
        floors.append(floor(path))
        print(json.dumps({"round": rnd, **floors[-1]}, default=float), flush=True)
        for name in names:
            steps = args.vmap_steps if name == "vmap" else args.steps
            out = subprocess.run([sys.executable, "-m", "benchmarks.seqrec.speed", "--variant", name, "--steps",
                                  str(steps), "--data-path", path, "--negatives", str(args.negatives),
                                  "--warm-epochs", str(args.warm_epochs), "--paired-epochs", str(args.paired_epochs)],
                                 capture_output=True, text=True, cwd=root)
            row = ({"variant": name, "error": out.stderr.strip().splitlines()[-1:]} if out.returncode
                   else json.loads(out.stdout.strip().splitlines()[-1]))
            runs.append({"round": rnd, **row})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "step_s"}), flush=True)
    fl = floors[0] if len(floors) == 1 else {
        **floors[0], "rounds": floors, "floor_epoch_s": float(np.median([f["floor_epoch_s"] for f in floors])),
        "floor_epoch_s_best_rows": float(np.median([f["floor_epoch_s_best_rows"] for f in floors]))}
    rows = {}
    for name in names:  # each variant's median epoch over the rounds (its first row if it failed everywhere)
        if name == "paired":
            continue
        ok = [r for r in runs if r["variant"] == name and "epoch_s" in r]
        rows[name] = (dict(ok[0], epoch_s=float(np.median([r["epoch_s"] for r in ok])),
                           peak_rss_gib=max(r["peak_rss_gib"] for r in ok)) if ok
                      else next(r for r in runs if r["variant"] == name))
    summary = {"floor_epoch_s": fl["floor_epoch_s"], "host_malloc": os.environ["JDP_HOST_MALLOC"]}
    for name in rows:
        if "epoch_s" in rows[name]:
            summary[f"{name}_epoch_s"] = rows[name]["epoch_s"]
            summary[f"{name}_peak_rss_gib"] = rows[name]["peak_rss_gib"]
    if "nonprivate_epoch_s" in summary:
        summary["nonprivate_epoch_s / floor_epoch_s"] = summary["nonprivate_epoch_s"] / summary["floor_epoch_s"]
        if "floor_epoch_s_best_rows" in fl:  # not the target's definition: the matmul's best rate on this host
            summary["nonprivate_epoch_s / floor_epoch_s_best_rows"] = (summary["nonprivate_epoch_s"]
                                                                       / fl["floor_epoch_s_best_rows"])
        if "dp_epoch_s" in summary:
            summary["dp_epoch_s / nonprivate_epoch_s"] = summary["dp_epoch_s"] / summary["nonprivate_epoch_s"]
        if "vmap_epoch_s" in summary:
            summary["vmap_epoch_s / nonprivate_epoch_s"] = summary["vmap_epoch_s"] / summary["nonprivate_epoch_s"]
    for name in ("nonprivate", "dp"):  # the library default "auto" against one pass per physical chunk
        if f"{name}_whole_epoch_s" in summary and f"{name}_epoch_s" in summary:
            summary[f"{name}_whole_epoch_s / {name}_epoch_s"] = (summary[f"{name}_whole_epoch_s"]
                                                                 / summary[f"{name}_epoch_s"])
    if "dp_sampled_epoch_s" in summary and "dp_epoch_s" in summary:
        summary["dp_sampled_epoch_s / dp_epoch_s"] = summary["dp_sampled_epoch_s"] / summary["dp_epoch_s"]
    pairs = [r for r in runs if r["variant"] == "paired" and "dp_epoch_s" in r]
    if pairs:  # both in one process, step by step (`paired`): medians over the rounds
        for k in ("nonprivate_epoch_s", "dp_epoch_s"):
            summary[f"paired_{k}"] = float(np.median([r[k] for r in pairs]))
        summary["paired_peak_rss_gib"] = max(r["peak_rss_gib"] for r in pairs)
        summary[PAIRED_KEY] = summary["paired_dp_epoch_s"] / summary["paired_nonprivate_epoch_s"]
        summary["paired_dp_over_nonprivate_per_step_median"] = float(np.median(
            [r["dp_over_nonprivate_per_step"]["median"] for r in pairs]))
    summary["targets"] = {k: {"target": v, "met": bool(summary[k] <= v)} for k, v in TARGETS.items() if k in summary}
    if PAIRED_KEY in summary:
        summary["targets"][PAIRED_KEY] = {"target": TARGETS["dp_epoch_s / nonprivate_epoch_s"],
                                          "met": bool(summary[PAIRED_KEY] <= TARGETS["dp_epoch_s / nonprivate_epoch_s"])}
    print(json.dumps(summary, indent=1))
    full = names == FULL
    name = ("seqrec_speed" if full else "seqrec_speed_" + "_".join(names)
            ) + ("_reuse_host_memory" if args.reuse_host_memory else "")
    write_results(name, runs, floor=fl,
                  summary=summary, **summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
