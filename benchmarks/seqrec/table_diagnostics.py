"""NON-PRIVATE diagnostic: is the private Transformers' popularity plateau a model that reads a noisy item table
badly, or a table whose rows never learn? (Amazon Games, the final states of the two partial-noise runs.)

    PYTHONPATH=. python -m benchmarks.seqrec.table_diagnostics --clean CLEAN.ckpt --noisy NOISY.ckpt [--data-dir DIR]
        [--also MODEL=F.ckpt ...]

CLEAN / NOISY: `python -m benchmarks.seqrec.partial_noise body --checkpoint CLEAN.ckpt` (DP-SGD noise on every
parameter but the item table) and `... item --checkpoint NOISY.ckpt` (noise on the item table only). Measured:
1. reader: validation NDCG@10 of a trained model after adding iid N(0, s²) to every entry of its item table
   (2 draws per s > 0), s up to twice the distance Adam's pure-noise walk moves a coordinate in 20 epochs (3.);
   `--also` adds other checkpoints (e.g. a private LSTM run's) to this test.
2. rows: per popularity band (training-target counts: exact, a diagnostic only), how far each row moved from its
   initialisation in both runs, and the cosine between the two movements (how much of the noise-free run's
   learned direction the noisy-table run found).
3. Adam's walk on pure noise: the distance the committed optimizer (adamw, lr 3e-3, 20% warm-up then linear decay,
   weight decay 1e-5) moves a 64-wide row in 606 steps (20 epochs) and 3,029 (100 epochs) when every gradient is
   pure noise, at two noise scales (Adam normalises the scale away).
4. rows needed: the noise-free-table model with only its K most popular rows kept, every other row reset to its
   initial value plus a pure-noise walk of the 20-epoch distance (3.): what a run that learned only those K rows
   could reach with this body.
5. structure (independent of the rows' basis): the correlation, over item pairs, of the rows' pairwise cosines
   between two tables (noise-free vs noisy run, each vs the initial table), for the most popular items.
Writes benchmarks/seqrec/results/seqrec_table_diagnostics.json.
"""
from __future__ import annotations

import argparse
import pathlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import write_results
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import evaluate as E
from jdp.seqrec import models
from jdp.seqrec import train

BANDS = [(0, 100), (100, 500), (500, 2000), (2000, 8000), (8000, None)]
STDS = [0.0, 0.02, 0.04, 0.08]


def load_params(path: str):
    """The parameters of a `train.train` checkpoint (no target structure needed)."""
    state = flax.serialization.msgpack_restore(open(path, "rb").read())
    return jax.tree.map(jnp.asarray, state["params"])


def table(params) -> jax.Array:
    return params["params"]["item_embed"]["embedding"]


def with_table(params, tab):
    inner = dict(params["params"], item_embed={"embedding": tab})
    return {**params, "params": inner}


def reader_sensitivity(model, params, data, cfg) -> list[dict]:
    rank_fn = E.make_rank_fn_reatt(model)
    windows = tuple(int(w) for w in cfg.length_buckets if int(w) > 0 and int(w) & (int(w) - 1) == 0)
    tab, rows = table(params), []
    for s in STDS:
        for draw in range(1 if s == 0 else 2):
            noisy = tab + s * jax.random.normal(jax.random.key(100 + draw), tab.shape)
            m = E.evaluate(model, with_table(params, noisy), data.valid_input, data.valid_target, chunk=cfg.eval_chunk,
                           rank_fn=rank_fn, length_buckets=windows)
            rows.append({"std": s, "draw": draw, "ndcg_at_10_valid": m["ndcg"], "hit_at_10_valid": m["hit"]})
            print(f"  s = {s:.2f} draw {draw}: validation NDCG@10 {100 * m['ndcg']:.2f}%", flush=True)
    return rows


def row_movement(init, clean, noisy, counts, order) -> list[dict]:
    d_clean, d_noisy = clean - init, noisy - init
    out = []
    for lo, hi in BANDS:
        r = order[lo:hi]
        n_c, n_n = np.linalg.norm(d_clean[r], axis=1), np.linalg.norm(d_noisy[r], axis=1)
        cos = np.sum(d_clean[r] * d_noisy[r], axis=1) / np.maximum(n_c * n_n, 1e-12)
        out.append({"popularity_ranks": [lo, lo + len(r)], "count_range": [int(counts[r].min()), int(counts[r].max())],
                    "moved_clean": float(n_c.mean()), "moved_noisy": float(n_n.mean()), "cosine": float(cos.mean())})
        print(f"  ranks {lo}-{lo + len(r)} (counts {counts[r].min()}-{counts[r].max()}): moved {n_c.mean():.3f} clean, "
              f"{n_n.mean():.3f} noisy; cosine {cos.mean():.3f}", flush=True)
    return out


def rows_needed(model, params, init, order, walk_distance, data, cfg) -> list[dict]:
    rank_fn = E.make_rank_fn_reatt(model)
    windows = tuple(int(w) for w in cfg.length_buckets if int(w) > 0 and int(w) & (int(w) - 1) == 0)
    tab = np.asarray(table(params))
    walk = walk_distance / np.sqrt(tab.shape[1]) * np.asarray(jax.random.normal(jax.random.key(5), tab.shape))
    out = []
    for k in (500, 2000, 8000):
        rest = order[k:]
        mixed = tab.copy()
        mixed[rest] = init[rest] + walk[rest]
        m = E.evaluate(model, with_table(params, jnp.asarray(mixed)), data.valid_input, data.valid_target,
                       chunk=cfg.eval_chunk, rank_fn=rank_fn, length_buckets=windows)
        out.append({"rows_kept": k, "ndcg_at_10_valid": m["ndcg"], "hit_at_10_valid": m["hit"]})
        print(f"  top {k} rows kept: validation NDCG@10 {100 * m['ndcg']:.2f}%", flush=True)
    return out


def similarity_structure(tables: dict, order) -> list[dict]:
    def cosines(tab, idx):
        rows = tab[idx] / np.linalg.norm(tab[idx], axis=1, keepdims=True)
        return (rows @ rows.T)[np.triu_indices(len(idx), 1)]
    out = []
    for lo, hi in [(0, 100), (0, 500), (500, 2000)]:
        idx = order[lo:hi]
        c = {n: cosines(t, idx) for n, t in tables.items()}
        row = {"popularity_ranks": [lo, hi]}
        for a, b in [("clean", "noisy"), ("clean", "init"), ("noisy", "init")]:
            row[f"{a}_vs_{b}"] = float(np.corrcoef(c[a], c[b])[0, 1])
        out.append(row)
        print(f"  ranks {lo}-{hi}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if "_vs_" in k), flush=True)
    return out


def adam_noise_walk(steps: int, scale: float, rows: int = 2000, d: int = 64) -> float:
    """Mean row distance travelled by adamw on pure N(0, scale²) gradients under the committed schedule."""
    opt = optax.adamw(train.lr_schedule(3e-3, steps, 0.2), weight_decay=1e-5)

    def body(i, carry):
        x, st = carry
        g = scale * jax.random.normal(jax.random.fold_in(jax.random.key(7), i), x.shape)
        upd, st = opt.update(g, st, x)
        return optax.apply_updates(x, upd), st
    x0 = jnp.zeros((rows, d))
    x, _ = jax.jit(lambda x: jax.lax.fori_loop(0, steps, body, (x, opt.init(x))))(x0)
    return float(jnp.mean(jnp.linalg.norm(x, axis=1)))


def _file(path: str) -> str:
    """A checkpoint as the results name it: its file name only (no folder of this machine)."""
    return f"<{pathlib.PurePath(path).name}>"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean", required=True, help="final state of `seqrec_partial_noise body --checkpoint`")
    ap.add_argument("--noisy", required=True, help="final state of `seqrec_partial_noise item --checkpoint`")
    ap.add_argument("--also", nargs="*", default=[], metavar="MODEL=CKPT", help="more checkpoints for the reader test")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    data = D.load("amazon-games", path=fetch("amazon-games", args.data_dir))
    cfg = train.TrainConfig(model="transformer", dropout=0.5)  # the partial-noise runs' model

    def make(name):
        return models.make_model(name, data.n_items, data.maxlen, cfg.d, cfg.heads, cfg.blocks, cfg.dropout,
                                 cfg.activation, cfg.norm, cfg.ffn_dim, cfg.item_dim)

    model = make("transformer")
    clean, noisy = load_params(args.clean), load_params(args.noisy)
    # the initial table: `train.train` splits key(0) into (init, histogram, training) keys
    k_init = jax.random.split(jax.random.key(0), 3)[0]
    init = np.asarray(table(jax.jit(model.init)(k_init, jnp.zeros((1, data.maxlen), jnp.int32))))
    if not np.array_equal(init[0], np.asarray(table(clean))[0]):  # the padding row never moves without noise
        raise ValueError("the clean run's padding row differs from the reconstructed initial table")

    result = {"reader": {}}
    for name, params in [("transformer, noise-free table (clean)", clean), ("transformer, noisy table", noisy)]:
        print(name, flush=True)
        result["reader"][name] = reader_sensitivity(model, params, data, cfg)
    for spec in args.also:
        name, path = spec.split("=", 1)
        print(name, path, flush=True)
        result["reader"][f"{name} ({pathlib.PurePath(path).name})"] = reader_sensitivity(make(name), load_params(path),
                                                                                        data, cfg)
    counts = np.bincount(np.asarray(data.train_target).ravel(), minlength=data.n_items + 1)
    counts[0] = 0
    order = np.argsort(-counts[1:], kind="stable") + 1  # item ids by popularity (id 0: padding)
    print("rows", flush=True)
    result["rows"] = row_movement(init, np.asarray(table(clean)), np.asarray(table(noisy)), counts, order)
    result["initial_row_norm"] = float(np.linalg.norm(init[1:], axis=1).mean())
    result["adam_noise_walk"] = [{"steps": n, "noise_scale": s, "row_distance": adam_noise_walk(n, s)}
                                 for n in (606, 3029) for s in (8.4e-4, 1.0)]
    print(result["adam_noise_walk"], flush=True)
    print("rows needed", flush=True)
    result["rows_needed"] = rows_needed(model, clean, init, order, result["adam_noise_walk"][0]["row_distance"], data,
                                        cfg)
    print("structure", flush=True)
    result["structure"] = similarity_structure({"clean": np.asarray(table(clean)), "noisy": np.asarray(table(noisy)),
                                                "init": init}, order)
    also = [f"{spec.split('=', 1)[0]}={_file(spec.split('=', 1)[1])}" for spec in args.also]
    command = " ".join(["python -m benchmarks.seqrec.table_diagnostics", "--clean", _file(args.clean), "--noisy",
                        _file(args.noisy)] + (["--also", *also] if also else [])
                       + (["--data-dir", "<datasets>"] if args.data_dir else []))
    path = write_results("seqrec_table_diagnostics", [result], command, nonprivate_diagnostic=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
