"""Synthetic scenarios: noise-free MSE vs ε curves (exact output probabilities) for every mechanism.

    PYTHONPATH=. python -m benchmarks.selection.synthetic [--k 100] [--trials 32] [--seed 0]
writes benchmarks/selection/results/selection_synthetic.json and selection_synthetic.png, and checks the paper's
qualitative orderings at ε ∈ {0.1, 1} (recorded under "orderings").
"""
from __future__ import annotations

import argparse
import sys
import pathlib

import numpy as np
from tqdm import tqdm

from benchmarks.common import results_dir, write_results
from jdp.selection import scenarios as SC

RESULTS_DIR = results_dir(__file__)


def orderings(curves: dict, eps: list) -> dict:
    """The acceptance orderings, evaluated on the computed curves."""
    out = {}
    for e in (0.1, 1.0):
        i = eps.index(e)
        pos, neg, pol = curves["bimodal-positive"], curves["bimodal-negative"], curves["polarised-strong"]
        out[f"eps={e}"] = {
            "positive: mgem < rnm-exp": pos["mgem"][i] < pos["rnm-exp"][i],
            "positive: rs-geometric < rnm-exp": pos["rs-geometric"][i] < pos["rnm-exp"][i],
            "positive: gem > uniform": pos["gem"][i] > pos["uniform"][i],
            "negative: gem < rnm-exp": neg["gem"][i] < neg["rnm-exp"][i],
            "negative: gem < mgem": neg["gem"][i] < neg["mgem"][i],
            "polarised-strong: combined-gem < gem and < mgem":
                pol["combined-gem"][i] < min(pol["gem"][i], pol["mgem"][i]),
            "none: rnm-exp best of rnm-exp/gem/mgem/rs": curves["smooth-none"]["rnm-exp"][i] <= min(
                curves["smooth-none"][m][i] for m in ("gem", "mgem", "rs-geometric")),
        }
    return out


def plot(curves: dict, eps: list, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(curves)
    cols = 4
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for mech, ys in curves[name].items():
            style = ":" if mech.endswith("nonprivate") else "-"
            ax.plot(eps, ys, style, marker=".", label=mech)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ε")
        ax.set_ylabel("MSE")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    eps = list(SC.DEFAULT_EPSILONS)
    curves, info, rows = {}, {}, []
    for i, sc in enumerate(tqdm(SC.all_scenarios(), desc="scenarios")):
        q, d = sc.draw(np.random.default_rng([args.seed, i]), args.trials, args.k)
        curves[sc.name] = SC.mse_curves(q, d, epsilons=eps)
        from jdp.selection.correlation import spearman, weighted_correlation
        info[sc.name] = {"description": sc.description,
                         "mean_spearman": float(np.mean(np.asarray(spearman(q, d)))),
                         "mean_weighted_correlation": float(np.mean(np.asarray(weighted_correlation(q, d))))}
        for mech, ys in curves[sc.name].items():
            rows += [dict(scenario=sc.name, mechanism=mech, epsilon=e, mse=y) for e, y in zip(eps, ys)]
    checks = orderings(curves, eps)
    png = RESULTS_DIR / "selection_synthetic.png"
    plot(curves, eps, png)
    path = write_results("selection_synthetic", rows, command=" ".join(["PYTHONPATH=. python -m benchmarks.selection.synthetic"] + sys.argv[1:]), k=args.k, trials=args.trials, seed=args.seed,
                         epsilons=eps, scenarios=info, orderings=checks, curves=curves, plot=png.name)
    for e, table in checks.items():
        for name, ok in table.items():
            print(f"{e:8s} {'OK ' if ok else 'NO '} {name}")
    print("wrote", path, png)


if __name__ == "__main__":
    main()
