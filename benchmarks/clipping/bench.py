"""Step time and peak memory of DP-SGD clipping methods on the DPFormer-size model, side by side.

Model: Transformer, d=64, 1 head, 2 blocks, learned positional embedding, tied input/output item
embedding, causal next-item loss at every position over the full vocabulary (DPFormer, Ding et al.).
Methods (one Adam step each, same model, same batch, same process):
  nonprivate        grad of the summed loss (baseline)
  jdp-auto          jdp.clipping: taps, mixed ghost/instantiated norms, Phantom (tied embedding), BK
  jdp-ghost         jdp.clipping with ghost norms for every matrix site, BK
  jdp-two-pass      jdp.clipping norms + second backward of sum_b c_b loss_b
  jdp-vmap          jdp.clipping's exact fallback for every parameter (per-example grads by vmap)
  jax_privacy       jax_privacy.clipping.clipped_grad (vmap of per-example grads), when installed
DP rows add Gaussian noise (dp_aggregate) before Adam. Peak memory is XLA's buffer assignment of the
compiled step (arguments + outputs + temporaries - aliases, `memory_analysis()`); configurations whose
compiled peak exceeds --memory-budget-gb are recorded as `oom: true` without running them (the
machine is shared). Step times are medians over repeats interleaved across methods, so ratios are
taken side by side under the same load.

  PYTHONPATH=. python -m benchmarks.clipping.bench              # default grid (~10 min on 2 cores)
  PYTHONPATH=. python -m benchmarks.clipping.bench --grid full  # vocab x L x batch 256..4096
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import results_dir, write_results
import jdp.clipping as jc

RESULTS_DIR = results_dir(__file__)

VOCABS = {"ml-1m": 3416, "amazon-games": 23715}


class DPFormerSize(nn.Module):
    """Tied-embedding causal Transformer of the DPFormer paper's size (no Re-Attention, no dropout)."""
    vocab: int
    max_len: int
    dim: int = 64
    blocks: int = 2

    @nn.compact
    def __call__(self, seq):
        item = nn.Embed(self.vocab + 1, self.dim, name="item")          # id 0 = padding
        h = item(seq) * (self.dim ** 0.5) + nn.Embed(self.max_len, self.dim, name="pos")(
            jnp.arange(seq.shape[1]))[None]
        mask = nn.make_causal_mask(seq) * nn.make_attention_mask(seq > 0, seq > 0)
        for _ in range(self.blocks):
            y = nn.LayerNorm()(h)
            h = h + nn.MultiHeadDotProductAttention(num_heads=1)(y, mask=mask)
            y = nn.LayerNorm()(h)
            h = h + nn.Dense(self.dim)(nn.gelu(nn.Dense(self.dim)(y)))
        return item.attend(nn.LayerNorm()(h))


def make_loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["seq"])
        lp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(lp, batch["tgt"][..., None], -1)[..., 0]
        return jnp.sum(nll * (batch["tgt"] > 0), axis=1)           # per-example (per-user) loss
    return loss_fn


def make_batch(key, B, L, vocab):
    """Zipf-distributed items (long tail), random lengths, left padding with 0."""
    k1, k2 = jax.random.split(key)
    u = jax.random.uniform(k1, (B, L + 1))
    ranks = jnp.floor(jnp.exp(u * jnp.log(vocab))).astype(jnp.int32)     # log-uniform ranks
    items = (jnp.clip(ranks, 1, vocab)).astype(jnp.int32)
    lengths = jax.random.randint(k2, (B, 1), 3, L + 2)
    pos = jnp.arange(L + 1)[None]
    items = jnp.where(pos >= L + 1 - lengths, items, 0)
    return {"seq": items[:, :-1], "tgt": items[:, 1:]}


def make_steps(loss_fn, methods, chunk=None):
    """{name: (step function, is_dp)} for one Adam step of each method on `loss_fn` (per-example losses);
    `chunk`: jdp-auto's examples per chunk, for the nonprivate-chunked row (only when it divides the batch)."""
    opt = optax.adam(1e-3)
    noise = jc.dp_aggregate(1.0, 1.0, 1.0, jax.random.PRNGKey(0))
    steps = {}

    def nonprivate(params, opt_state, batch, mask):
        g = jax.grad(lambda p: jnp.sum(loss_fn(p, batch) * mask))(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    steps["nonprivate"] = (nonprivate, False)

    if chunk:  # the same batch_chunk as jdp-auto, for the non-private gradient: does chunking alone speed it up?
        def nonprivate_chunked(params, opt_state, batch, mask):
            def grad(bm):
                b, m = bm
                return jax.grad(lambda p: jnp.sum(loss_fn(p, b) * m))(params)
            B = mask.shape[0]
            parts = jax.tree.map(lambda x: x.reshape((B // chunk, chunk) + x.shape[1:]), (batch, mask))
            g = jax.tree.map(lambda x: jnp.sum(x, axis=0), jax.lax.map(grad, parts))
            upd, opt_state = opt.update(g, opt_state, params)
            return optax.apply_updates(params, upd), opt_state

        steps["nonprivate-chunked"] = (nonprivate_chunked, False)

    def dp_step(grad_fn, params, state, batch, mask):
        nstate, ostate = state
        g = grad_fn(params, batch, mask)
        g, nstate = noise.update(g, nstate)
        upd, ostate = opt.update(g, ostate, params)
        return optax.apply_updates(params, upd), (nstate, ostate)

    for m in ("auto", "ghost", "ghost-two-pass", "vmap"):
        name = "jdp-" + {"ghost-two-pass": "two-pass"}.get(m, m)
        fn = functools.partial(lambda p, b, mk, m=m: jc.clipped_grad(
            loss_fn, p, b, l2_clip=1.0, mask=mk, method=m, normalize=True).grad_sum)
        steps[name] = (functools.partial(dp_step, fn), True)
    # jdp-auto runs the batch in cache-sized chunks on CPU (batch_chunk="auto"); this row is one whole-batch pass
    fn = lambda p, b, mk: jc.clipped_grad(loss_fn, p, b, l2_clip=1.0, mask=mk, normalize=True,  # noqa: E731
                                          batch_chunk=None).grad_sum
    steps["jdp-auto-whole"] = (functools.partial(dp_step, fn), True)
    try:
        from jax_privacy import clipping as jpc

        def jp_grad(p, b, mk):
            # jax_privacy's per-example losses come from batches of 1; padding via is_padding_example
            # is not needed here (the benchmark batches have no padding rows).
            del mk
            return jpc.clipped_grad(lambda p_, b_: jnp.sum(loss_fn(p_, b_)), l2_clip_norm=1.0,
                                    rescale_to_unit_norm=False, batch_argnums=1)(p, b)

        steps["jax_privacy"] = (functools.partial(dp_step, jp_grad), True)
    except ImportError:
        pass
    return {k: v for k, v in steps.items() if k in methods}


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    peak = getattr(m, "peak_memory_in_bytes", 0) or 0
    est = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return int(max(peak, est))


CAPPED_METHODS = ("jax_privacy",)


def measure(loss_fn, params, batch, methods, reps, budget, max_seconds, step_time_cap=None):
    """Compiles and times one step of each method side by side on one batch.

    Returns ({method: row}, unfinished); rows carry step_seconds, peak_memory_bytes, compile_seconds
    and the ratios dp_over_nonprivate / memory_over_nonprivate."""
    B = int(jax.tree.leaves(batch)[0].shape[0])
    mask = jnp.ones((B,), jnp.float32)
    opt_state = optax.adam(1e-3).init(params)
    nstate = jc.dp_aggregate(1.0, 1.0, 1.0, jax.random.PRNGKey(0)).init(params)
    rows, compiled = {}, {}
    chunk = jc.explain(loss_fn, params, batch)[-1]["batch_chunk"] if "nonprivate-chunked" in methods else None
    chunk = chunk if chunk and chunk < B and B % chunk == 0 else None
    for name, (fn, dp) in make_steps(loss_fn, methods, chunk).items():
        state = (nstate, opt_state) if dp else opt_state
        t0 = time.perf_counter()
        try:
            c = jax.jit(fn).lower(params, state, batch, mask).compile()
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            rows[name] = {"oom": True, "error": f"compile failed: {type(e).__name__}: {str(e)[:200]}"}
            continue
        mem = peak_bytes(c)
        rows[name] = {"peak_memory_bytes": mem, "compile_seconds": round(time.perf_counter() - t0, 2)}
        if mem > budget:
            rows[name].update(oom=True, oom_reason=f"compiled peak {mem / 2**30:.2f} GiB > budget "
                                                    f"{budget / 2**30:.1f} GiB (not run)")
            continue
        compiled[name] = (c, state)
        print(f"  compiled {name}: peak {mem / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    # methods run under a time cap go last, alone, after every other method's repeats (see below)
    capped = {k: compiled.pop(k) for k in list(compiled) if step_time_cap and k in CAPPED_METHODS}
    times = {k: [] for k in compiled}
    rounds = []  # one {method: seconds} per round of interleaved repeats, for paired ratios
    for name, (c, state) in compiled.items():     # warm-up
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(c(params, state, batch, mask))
        except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED at run time
            rows[name].update(oom=True, error=f"{type(e).__name__}: {str(e)[:200]}")
            times.pop(name)
            continue
        rows[name]["first_step_seconds"] = time.perf_counter() - t0
    for _ in range(reps):
        rounds.append({})
        for name in list(times):
            c, state = compiled[name]
            if len(times[name]) >= 1 and rows[name]["first_step_seconds"] * (len(times[name]) + 1) > max_seconds:
                continue   # very slow methods: fewer repeats
            t0 = time.perf_counter()
            jax.block_until_ready(c(params, state, batch, mask))
            times[name].append(time.perf_counter() - t0)
            rounds[-1][name] = times[name][-1]
    for name, ts in times.items():
        if not ts:
            ts = [rows[name]["first_step_seconds"]]
        rows[name]["step_seconds"] = float(np.median(ts))
        rows[name]["repeats"] = len(ts)
    unfinished = False
    for name, (c, state) in capped.items():  # one step in a thread; if it outlives the cap, a lower bound
        worker = threading.Thread(target=lambda c=c, state=state: jax.block_until_ready(c(params, state, batch, mask)),
                                  daemon=True)
        t0 = time.perf_counter()
        worker.start()
        worker.join(step_time_cap)
        if worker.is_alive():
            rows[name].update(step_seconds_lower_bound=time.perf_counter() - t0, did_not_finish=True,
                              note=f"first step still running after the {step_time_cap:.0f} s cap (nothing else ran)")
            unfinished = True  # the computation cannot be cancelled: run no further configurations
            break
        rows[name].update(step_seconds=time.perf_counter() - t0, repeats=1,
                          note="one (first) step, run alone after the other methods, under --step-time-cap")
    base = rows.get("nonprivate", {})
    for name, r in rows.items():
        row = r
        if name != "nonprivate" and "step_seconds" in r and "step_seconds" in base:
            row["dp_over_nonprivate"] = r["step_seconds"] / base["step_seconds"]
            paired = [t[name] / t["nonprivate"] for t in rounds if name in t and "nonprivate" in t]
            if paired:  # the ratio within each round (same machine state), then the median over rounds
                row["dp_over_nonprivate_paired_median"] = float(np.median(paired))
        if "step_seconds_lower_bound" in r and "step_seconds" in base:
            row["dp_over_nonprivate_lower_bound"] = r["step_seconds_lower_bound"] / base["step_seconds"]
        if name != "nonprivate" and "peak_memory_bytes" in r and "peak_memory_bytes" in base:
            row["memory_over_nonprivate"] = r["peak_memory_bytes"] / base["peak_memory_bytes"]
    return rows, unfinished


def bench_config(vocab, L, B, dim, methods, reps, budget, max_seconds, step_time_cap=None):
    model = DPFormerSize(vocab, L, dim)
    batch = make_batch(jax.random.PRNGKey(0), B, L, vocab)
    params = model.init(jax.random.PRNGKey(1), batch["seq"][:1])["params"]
    rows, unfinished = measure(make_loss(model), params, batch, methods, reps, budget, max_seconds, step_time_cap)
    return [{"method": name, "vocab": vocab, "seq_len": L, "batch": B, "dim": dim, **r}
            for name, r in rows.items()], unfinished


GRIDS = {
    "default": [(23715, 50, 1024), (23715, 50, 256), (3416, 50, 256), (3416, 200, 256)],
    "full": list(itertools.product([3416, 23715], [50, 200], [256, 1024, 4096])),
    "b256": [(23715, 50, 256), (3416, 50, 256), (3416, 200, 256)],
    "accept": [(23715, 50, 1024)],
    "v23715-b256": [(23715, 50, 256)],
    "v3416-b256": [(3416, 50, 256), (3416, 200, 256)],
    "tiny": [(200, 10, 32)],
}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfgs = sorted({(r["vocab"], r["seq_len"], r["batch"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(len(cfgs))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        t = [next((r.get("step_seconds", np.nan) for r in rows if r["method"] == m and
                   (r["vocab"], r["seq_len"], r["batch"]) == c and not r.get("oom")), np.nan) for c in cfgs]
        mem = [next((r.get("peak_memory_bytes", np.nan) / 2**30 for r in rows if r["method"] == m and
                     (r["vocab"], r["seq_len"], r["batch"]) == c), np.nan) for c in cfgs]
        axes[0].bar(x + i * w, t, w, label=m)
        axes[1].bar(x + i * w, mem, w, label=m)
    for ax, lab in zip(axes, ["step seconds (log)", "compiled peak memory GiB (log)"]):
        ax.set_yscale("log")
        ax.set_ylabel(lab)
        ax.set_xticks(x + 0.4 - w / 2)
        ax.set_xticklabels([f"V={v}\nL={l} B={b}" for v, l, b in cfgs], fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="default", choices=sorted(GRIDS))
    ap.add_argument("--methods", default="nonprivate,jdp-auto,jdp-ghost,jdp-two-pass,jdp-vmap,jax_privacy")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-budget-gb", type=float, default=8.0)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="per method and config, for repeats")
    ap.add_argument("--name", default="clipping")
    ap.add_argument("--step-time-cap", type=float, default=None,
                    help="seconds: run jax_privacy last, alone, one step; if it is still running after the cap, "
                         "record the cap as a lower bound and stop")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    rows = []
    for vocab, L, B in GRIDS[args.grid]:
        print(f"vocab={vocab} L={L} B={B}", file=sys.stderr, flush=True)
        new, unfinished = bench_config(vocab, L, B, args.dim, methods, args.reps, args.memory_budget_gb * 2**30,
                                       args.max_seconds, args.step_time_cap)
        rows += new
        for r in new:
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
                  file=sys.stderr, flush=True)
        write_results(args.name, rows, grid=args.grid, memory_source="XLA compiled memory_analysis",
                      memory_budget_gb=args.memory_budget_gb)
        if unfinished:  # a capped step is still computing in a thread that cannot be stopped
            print("stopping after a capped step outlived its cap", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(0)
    path = write_results(args.name, rows, grid=args.grid, memory_source="XLA compiled memory_analysis",
                         memory_budget_gb=args.memory_budget_gb)
    try:
        plot(rows, RESULTS_DIR / f"{args.name}.png")
    except ImportError:
        pass
    print(path)


if __name__ == "__main__":
    main()
