"""Clipping on models written the way Flax's own examples write them (not for jdp), side by side.

Models (each a per-example cross-entropy on synthetic data of the right shape):
  mnist_cnn      Flax MNIST example CNN: Conv 32 / Conv 64 (3x3, SAME) + avg-pool, Dense 256, Dense 10
  resnet18_cifar ResNet-18 basic-block stack for 32x32x3 at 1/4 width (16-32-64-128 channels), GroupNorm
                 in place of BatchNorm (BatchNorm in training mode is refused by jdp: it has no
                 per-example meaning)
  lstm_classifier  Embed + nn.RNN(OptimizedLSTMCell) + Dense (Flax's SST-2 example style)
  lm_tied        decoder-only LM: Embed, MultiHeadDotProductAttention, LayerNorm, MLP, tied `attend`
                 (V=20k, d=64, L=50, 2 blocks)
  lm_tied_by_hand  the same LM tied by hand: logits = h @ embed.embedding.T
  nnx_cnn        the MNIST CNN written with flax.nnx (nnx.split / nnx.merge)
Methods: nonprivate (grad of the summed loss), jdp-auto (default: on CPU in cache-sized chunks of the batch),
jdp-auto-whole (batch_chunk=None: one pass over the whole batch), nonprivate-chunked (the non-private gradient in
jdp-auto's chunks), jdp-ghost, jdp-two-pass, jdp-vmap (= plain vmap(grad) per-example gradients), jax_privacy
when it is installed. One Adam step each, timed side
by side in one process (medians of interleaved repeats; see benchmarks.clipping.bench.measure), with
XLA's compiled peak memory.

  PYTHONPATH=. python -m benchmarks.clipping.external                   # all models
  PYTHONPATH=. python -m benchmarks.clipping.external --models mnist_cnn --reps 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.clipping.bench import measure
from benchmarks.common import write_results


def xent(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


class MnistCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(features=64, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(features=256)(x.reshape((x.shape[0], -1))))
        return nn.Dense(features=10)(x)


class BasicBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = nn.GroupNorm(num_groups=4)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = nn.GroupNorm(num_groups=4)(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet18(nn.Module):
    widths: tuple = (16, 32, 64, 128)

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)))
        for i, w in enumerate(self.widths):
            for j in range(2):
                x = BasicBlock(w, 2 if (i > 0 and j == 0) else 1)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class LSTMClassifier(nn.Module):
    vocab: int = 5000
    dim: int = 64

    @nn.compact
    def __call__(self, ids):
        h = nn.RNN(nn.OptimizedLSTMCell(self.dim))(nn.Embed(self.vocab, self.dim)(ids))
        return nn.Dense(2)(h[:, -1])


class TiedLM(nn.Module):
    vocab: int = 20000
    dim: int = 64
    max_len: int = 50
    blocks: int = 2
    by_hand: bool = False   # tie as many users write it: h @ embed.embedding.T instead of embed.attend(h)

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(self.vocab, self.dim)
        h = embed(ids) + nn.Embed(self.max_len, self.dim)(jnp.arange(ids.shape[1]))[None]
        mask = nn.make_causal_mask(ids)
        for _ in range(self.blocks):
            h = h + nn.MultiHeadDotProductAttention(num_heads=1)(nn.LayerNorm()(h), mask=mask)
            h = h + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(h))))
        h = nn.LayerNorm()(h)
        return h @ embed.embedding.T if self.by_hand else embed.attend(h)


class NnxCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(7 * 7 * 64, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.linear2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))


def _linen(model, x, y):
    params = model.init(jax.random.PRNGKey(1), x[:1])["params"]

    def loss_fn(p, b):
        return xent(model.apply({"params": p}, b["x"]), b["y"])
    return loss_fn, params, {"x": x, "y": y}


def _lm(model, ids):
    params = model.init(jax.random.PRNGKey(1), ids[:1, :-1])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"])
        lp = jax.nn.log_softmax(logits)
        return -jnp.sum(jnp.take_along_axis(lp, b["y"][..., None], -1)[..., 0], axis=1)
    return loss_fn, params, {"x": ids[:, :-1], "y": ids[:, 1:]}


def build(name: str, B: int):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    if name == "mnist_cnn":
        return _linen(MnistCNN(), jax.random.normal(k1, (B, 28, 28, 1)), jax.random.randint(k2, (B,), 0, 10))
    if name == "resnet18_cifar":
        return _linen(ResNet18(), jax.random.normal(k1, (B, 32, 32, 3)), jax.random.randint(k2, (B,), 0, 10))
    if name == "lstm_classifier":
        return _linen(LSTMClassifier(), jax.random.randint(k1, (B, 50), 0, 5000), jax.random.randint(k2, (B,), 0, 2))
    if name in ("lm_tied", "lm_tied_by_hand"):
        return _lm(TiedLM(by_hand=name == "lm_tied_by_hand"), jax.random.randint(k1, (B, 51), 0, 20000))
    if name == "nnx_cnn":
        graphdef, params = nnx.split(NnxCNN(nnx.Rngs(1)), nnx.Param)

        def loss_fn(p, b):
            return xent(nnx.merge(graphdef, p)(b["x"]), b["y"])
        return loss_fn, params, {"x": jax.random.normal(k1, (B, 28, 28, 1)), "y": jax.random.randint(k2, (B,), 0, 10)}
    raise ValueError(f"unknown model {name!r}")


BATCH = {"mnist_cnn": 256, "resnet18_cifar": 128, "lstm_classifier": 256, "lm_tied": 256, "lm_tied_by_hand": 256,
         "nnx_cnn": 256}


def table(rows: list[dict]) -> str:
    """Markdown: step time and compiled peak memory of each method as multiples of non-private."""
    methods = [m for m in ("jdp-auto", "jdp-auto-whole", "nonprivate-chunked", "jdp-ghost", "jdp-two-pass", "jdp-vmap",
                           "jax_privacy")
               if any(r["method"] == m for r in rows)]
    lines = ["| model (batch) | non-private step s | " + " | ".join(f"{m} time / mem" for m in methods) + " |",
             "|---" * (2 + len(methods)) + "|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        by = {r["method"]: r for r in rows if r["model"] == name}
        base = by.get("nonprivate", {})
        cells = []
        for m in methods:
            r = by.get(m, {})
            t = r.get("dp_over_nonprivate")
            mem = r.get("memory_over_nonprivate")
            cells.append("—" if t is None else f"{t:.2f}× / {mem:.2f}×")
        lines.append(f"| {name} ({base.get('batch', '?')}) | {base.get('step_seconds', float('nan')):.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(BATCH))
    ap.add_argument("--methods", default="nonprivate,jdp-auto,jdp-ghost,jdp-two-pass,jdp-vmap,jax_privacy")
    ap.add_argument("--batch", type=int, default=None, help="batch size for every model (default: per model)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-budget-gb", type=float, default=8.0)
    ap.add_argument("--max-seconds", type=float, default=90.0, help="per method and model, for repeats")
    ap.add_argument("--name", default="clipping_external")
    ap.add_argument("--step-time-cap", type=float, default=None,
                    help="seconds: jax_privacy runs last, alone, one step; a lower bound is recorded past the cap")
    ap.add_argument("--render", nargs="+", default=None, metavar="RESULT_JSON",
                    help="print the markdown table of these result files and exit")
    args = ap.parse_args(argv)
    if args.render:
        print(table([r for f in args.render for r in json.load(open(f))["results"]]))
        return
    rows = []
    for name in args.models.split(","):
        B = args.batch or BATCH[name]
        print(f"{name} B={B}", file=sys.stderr, flush=True)
        loss_fn, params, batch = build(name, B)
        measured, unfinished = measure(loss_fn, params, batch, args.methods.split(","), args.reps,
                                       args.memory_budget_gb * 2**30, args.max_seconds, args.step_time_cap)
        for method, r in measured.items():
            rows.append({"model": name, "method": method, "batch": B, **r})
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                  file=sys.stderr, flush=True)
        write_results(args.name, rows, memory_source="XLA compiled memory_analysis",
                      memory_budget_gb=args.memory_budget_gb)
        if unfinished:  # a capped step is still computing in a thread that cannot be stopped
            print("stopping after a capped step outlived its cap", file=sys.stderr, flush=True)
            os._exit(0)
    print(write_results(args.name, rows, memory_source="XLA compiled memory_analysis",
                        memory_budget_gb=args.memory_budget_gb))


if __name__ == "__main__":
    main()
