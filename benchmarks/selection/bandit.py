"""Two-arm bandit with distribution shift: cumulative reward of UCB vs private learners.

    PYTHONPATH=. python -m benchmarks.selection.bandit [--horizon 4000] [--seeds 5] [--epsilon 10]
writes benchmarks/selection/results/selection_bandit.json and .png. Our design (the paper's set-up was not
recoverable): arm means (0.6, 0.45), stds (0.05, 0.3), swapped at T/2; rewards clipped to [0, 1];
event-level DP (one reward), ε per reward as recorded in each learner's PrivacyReport.
"""
from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
from tqdm import tqdm

from benchmarks.common import results_dir, write_results
from jdp.selection import bandit as BD

RESULTS_DIR = results_dir(__file__)

LEARNERS = ("ucb", "dp-ucb", "window-rnm-exp", "window-gem", "window-mgem", "window-rs-geometric")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--horizon", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--epsilon", type=float, default=10.0)
    ap.add_argument("--window", type=int, default=400)
    ap.add_argument("--period", type=int, default=100)
    args = ap.parse_args(argv)
    bandit = BD.ShiftBandit(horizon=args.horizon, shift_at=args.horizon // 2)
    rows, curves, privacy = [], {}, {}
    for learner in tqdm(LEARNERS):
        runs = []
        for seed in range(args.seeds):
            out = BD.run_learner(learner, bandit, bandit.rewards(seed), jax.random.key(seed), args.epsilon,
                                 args.window, args.period)
            runs.append(out)
            rows.append(dict(learner=learner, seed=seed, cumulative_reward=out["cumulative_reward"],
                             regret=out["regret"]))
        curves[learner] = np.mean([r["reward_curve"] for r in runs], axis=0).tolist()
        privacy[learner] = runs[0]["privacy"]
    summary = {l: {"mean_cumulative_reward": float(np.mean([r["cumulative_reward"] for r in rows if r["learner"] == l])),
                   "mean_regret": float(np.mean([r["regret"] for r in rows if r["learner"] == l]))} for l in LEARNERS}
    png = RESULTS_DIR / "selection_bandit.png"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    step = max(args.horizon // 50, 1)
    for l, c in curves.items():
        ax.plot(np.arange(len(c)) * step, c, label=l)
    ax.axvline(bandit.shift_at, color="gray", ls=":")
    ax.set(xlabel="t", ylabel="cumulative reward", title=f"shift at t={bandit.shift_at}, ε={args.epsilon} per reward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    path = write_results("selection_bandit", rows, command=" ".join(["PYTHONPATH=. python -m benchmarks.selection.bandit"] + sys.argv[1:]), summary=summary, privacy=privacy, horizon=args.horizon,
                         epsilon=args.epsilon, window=args.window, period=args.period, curves=curves, plot=png.name,
                         bandit=dict(means=bandit.means, stds=bandit.stds, shift_at=bandit.shift_at))
    for l, s in summary.items():
        print(f"{l:22s} reward {s['mean_cumulative_reward']:9.1f}  regret {s['mean_regret']:8.1f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
