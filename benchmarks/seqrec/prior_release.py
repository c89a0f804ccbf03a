"""The item start's transition release scored alone, as a DPFormer run makes it: what the transition prior
(`TrainConfig.transition_prior`) starts from, beside what DP-SGD then trains.

    PYTHONPATH=. python -m benchmarks.seqrec.prior_release [--data amazon-games] [--data-dir DIR] [--epsilon 8]
        [--batch-size 1024] [--noises half default 0.88 0.74 0.675] [--seeds 0 1]

For every release noise σ_T (`--item-init-noise`; calibrated where `item_init_noise=None`: "default", the σ_T at
which the two item releases alone spend PRIOR_EPSILON_SHARE = 0.85 of ε (the default run, with the prior), "half"
ITEM_INIT_EPSILON_SHARE = half of it (the default without the prior); at ε = 8, 0.88 / 0.74 / 0.675 spend ~0.7 /
0.85 / 0.95 of it) and seed: the release of a DPFormer run with that `--seed` (the same key path as
`jdp.seqrec.prepare`: `releases.privacy_setup` with the run's k_hist; K from the public rule), the ε its item
releases spend alone, DP-SGD's σ for the rest of ε at the 20-epoch protocol, and the release's own scorer
(`TransitionModel.evaluate`, the last 3 items) on validation and test (full ranking, history not masked). No
network is trained. `--batch-size`: the run's B (it sets DP-SGD's σ only). Writes
benchmarks/seqrec/results/seqrec_prior_release.json (Amazon Games at ε = 8; else seqrec_prior_release_eps{ε}.json,
other data seqrec_prior_release_{data}_eps{ε}.json).
"""
from __future__ import annotations

import argparse
import dataclasses

import dp_accounting.dp_event as dpe
import jax

from benchmarks.common import write_results
from jdp import accounting
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import transitions as T
from jdp.seqrec.config import TrainConfig
from jdp.seqrec.releases import DP_SGD_STEP, privacy_setup

DELTA = 1e-5


def item_release_epsilon(report: accounting.PrivacyReport) -> float:
    """ε of the report's releases before DP-SGD (the histograms and the transition sums), composed alone."""
    events = [r.composed_event() for r in report.releases if r.name != DP_SGD_STEP]
    return accounting.compute_epsilon(dpe.ComposedDpEvent(events), report.delta)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="amazon-games", choices=["amazon-games", "ml-100k", "ml-1m"])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--noises", nargs="+", default=["half", "default", "0.88", "0.74", "0.675"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    data = D.load(args.data, path=fetch(args.data, args.data_dir))
    base = TrainConfig(epsilon=args.epsilon, delta=DELTA, epochs=20, batch_size=args.batch_size, normalize=True)
    rows = []
    for noise in args.noises:
        cfg = (base if noise == "default" else dataclasses.replace(base, transition_prior=False) if noise == "half"
               else dataclasses.replace(base, item_init_noise=float(noise)))
        for seed in args.seeds:
            k_hist = jax.random.split(jax.random.key(seed), 3)[1]  # prepare's split: k_init, k_hist, k_train
            setup = privacy_setup(data, cfg, k_hist)
            start = setup.item_start
            v = start.evaluate(data.valid_input, data.valid_target)
            t = start.evaluate(data.test_input, data.test_target)
            share = cfg.item_init_epsilon_share() if cfg.item_init_noise is None else None
            rows.append({"item_init_noise": cfg.item_init_noise, "epsilon_share": share, "seed": seed,
                         "sigma_t": start.noise_multiplier,
                         "k": int(start.items.size), "item_releases_epsilon": item_release_epsilon(setup.report),
                         "dp_sgd_noise_multiplier": setup.noise_multiplier, "report_epsilon": setup.report.epsilon(),
                         "ndcg_at_10_valid": v["ndcg"], "hit_at_10_valid": v["hit"], "ndcg_at_10_test": t["ndcg"],
                         "hit_at_10_test": t["hit"]})
            print(f"sigma_T {start.noise_multiplier:.3f} seed {seed}: K {start.items.size}, item releases eps "
                  f"{rows[-1]['item_releases_epsilon']:.2f}, DP-SGD sigma {setup.noise_multiplier:.3f}; "
                  f"valid {100 * v['ndcg']:.2f} test {100 * t['ndcg']:.2f}", flush=True)
    name = "seqrec_prior_release" if args.data == "amazon-games" else f"seqrec_prior_release_{args.data}"
    name += "" if args.epsilon == 8.0 and args.data == "amazon-games" else f"_eps{args.epsilon:g}"
    path = write_results(name, rows, data=args.data, epsilon=args.epsilon, delta=DELTA, batch_size=args.batch_size,
                         history=3,
                         note="the item start's release alone (no network); item_init_noise None: calibrated to "
                              "epsilon_share of epsilon")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
