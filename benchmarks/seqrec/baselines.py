"""What users get without a sequential model, on the seqrec splits (full ranking, NDCG@10 / HIT@10).

    PYTHONPATH=. python -m benchmarks.seqrec.baselines [--data-dir DIR] [--seeds 5]

Rows: zero cost (each user's own most recent items; nothing released), popularity from the item histogram that
DPFormer releases anyway (`reattention.private_item_counts` at the default noise, one release per seed: post-
processing, no further privacy cost) and popularity from the EXACT counts (a NON-PRIVATE reference). Datasets come
through `jdp.data.fetch` (Amazon Games, ML-100K). Writes benchmarks/seqrec/results/seqrec_baselines.json.
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks.common import write_results
from jdp import accounting
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import reattention as ra
from jdp.seqrec.evaluate import baseline_metrics
from jdp.seqrec.train import TrainConfig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    for name in ("amazon-games", "ml-100k"):
        d = D.load(name, path=fetch(name, args.data_dir, progress=False))
        exact = D.item_presence(d.train_input, d.train_target, d.n_items)
        base = baseline_metrics(d, exact)
        rows.append({"data": name, "baseline": "zero_cost", **base["zero_cost"]})
        rows.append({"data": name, "baseline": "popularity, exact counts (NON-PRIVATE)", **base["popularity"]})
        per_seed = []
        for seed in range(args.seeds):
            report = accounting.PrivacyReport(1e-5, unit="user")
            counts = ra.private_item_counts(jax.random.key(seed), exact, d.maxlen + 1,
                                            TrainConfig.hist_noise_multiplier, report)
            per_seed.append(baseline_metrics(d, counts)["popularity"])
        keys = per_seed[0].keys()
        rows.append({"data": name, "baseline": "popularity, DPFormer's released histogram", "seeds": args.seeds,
                     **{k: float(np.mean([s[k] for s in per_seed])) for k in keys},
                     **{k + "_std": float(np.std([s[k] for s in per_seed])) for k in keys}})
        for r in rows[-3:]:
            print(name, r["baseline"], f"NDCG@10 test {r['ndcg_at_10_test']:.4%}  HIT@10 test {r['hit_at_10_test']:.4%}")
    print("wrote", write_results("seqrec_baselines", rows, command="PYTHONPATH=. python -m benchmarks.seqrec.baselines"
                                 + (" --data-dir <cache>" if args.data_dir else "")))


if __name__ == "__main__":
    main()
