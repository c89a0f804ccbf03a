"""NON-PRIVATE diagnostic: DP-SGD's noise added to one parameter group only (the vanilla Transformer on Amazon Games).

    PYTHONPATH=. python -m benchmarks.seqrec.partial_noise {item|body} [--data-dir DIR] [--epochs 20] [--checkpoint F]

Trains the vanilla Transformer at the committed protocol (ε = 8 noise for `--epochs` epochs, normalised clipping
C = 1, B 1024, lr 3e-3, dropout 0.5, seed 0) with every user's gradient clipped as usual, but the Gaussian noise of
each step added ONLY to the item embedding table (`item`) or ONLY to the other parameters (`body`); the other group
receives its clipped sum without noise. This releases noise-free sums: it is NOT private and exists only to find out
which group's noise keeps the private Transformers at the popularity level. Writes
benchmarks/seqrec/results/seqrec_partial_noise_<group>.json; `--checkpoint F` also keeps the trained state in F (every
epoch and at the end; `--resume`-style: an existing F is continued), for `benchmarks.seqrec.table_diagnostics`.
"""
from __future__ import annotations

import argparse
import time

import jax

from benchmarks.common import write_results
from jdp import noise
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import item_table, train


def noise_only_on(group: str):
    """A replacement for `noise.add_gaussian_tree` that keeps the noise on one group's leaves only."""
    add = noise.add_gaussian_tree

    def add_to_group(key, tree, std):
        noisy = add(key, tree, std)
        keep = lambda path, clean, nz: nz if item_table.is_item_embedding(path) == (group == "item") else clean  # noqa: E731
        return jax.tree_util.tree_map_with_path(keep, tree, noisy)
    return add_to_group


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("group", choices=["item", "body"])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=float, default=20.0)
    ap.add_argument("--checkpoint", default=None, help="keep the trained state in this file (continued if it exists)")
    args = ap.parse_args(argv)
    data = D.load("amazon-games", path=fetch("amazon-games", args.data_dir))
    cfg = train.TrainConfig(model="transformer", item_init="random", epsilon=8.0, epochs=args.epochs, batch_size=1024, lr=3e-3,
                            normalize=True, dropout=0.5, eval_every_epochs=2)
    original = noise.add_gaussian_tree
    noise.add_gaussian_tree = noise_only_on(args.group)  # the DP-SGD step reads it when it is traced
    try:
        t0 = time.perf_counter()
        res = train.train(data, cfg, jax.random.key(0), progress=False, checkpoint=args.checkpoint)
    finally:
        noise.add_gaussian_tree = original
    row = {"noise_on": args.group, "metrics": res.metrics, "noise_multiplier": res.noise_multiplier,
           "steps": res.steps, "history": res.history, "seconds": time.perf_counter() - t0}
    print(f"wrote {write_results(f'seqrec_partial_noise_{args.group}', [row], nonprivate_diagnostic=True)}")


if __name__ == "__main__":
    main()
