"""Recommendation experiment: private choice of one item per user from EASE scores (ML-100K, Amazon Games).

Per user: candidates = the top-500 unseen items by EASE score; per-item sensitivity = 5%-95% spread of the
item's predicted score across users (declared public, as in the paper); error = mean over users of
E[(best score − selected score)²]. Exact probabilities for uniform/kRR/RNM/EM/GEM/mGEM/combined GEM;
Monte Carlo (--draws per user, via `select`) for RS_γ and the non-private RNMH reference, whose
heterogeneous-scale quadrature is costly at k = 500. Dense EASE stands in for SANSA; Amazon Games is
restricted to its 3000 most popular items so the dense inverse fits (documented deviation).

    PYTHONPATH=. python -m benchmarks.selection.recommendation [--users 200] [--draws 200]
writes benchmarks/selection/results/selection_recommendation.json and .png (MSE vs ε, per-user Spearman histogram).
"""
from __future__ import annotations

import argparse
import sys
import pathlib

import jax
import numpy as np
from tqdm import tqdm

from benchmarks.common import results_dir, write_results
from jdp import selection as S
from jdp.selection import ease as E
from jdp.selection import scenarios as SC

RESULTS_DIR = results_dir(__file__)

DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "datasets"
EXACT = ("uniform", "krr", "rnm-exp", "em", "gem", "mgem", "combined-gem")
SAMPLED = ("rs-geometric", "rnmh-nonprivate")


def mc_mse(name, q, d, eps, draws, seed):
    """Monte Carlo E[(q* − q_â)²] averaged over users, `draws` selections per user."""
    qq = np.repeat(q, draws, axis=0).astype(np.float32)
    dd = np.repeat(d, draws, axis=0).astype(np.float32)
    idx = np.asarray(S.select(name, jax.random.key(seed), qq, dd, eps, allow_nonprivate=True))
    chosen = np.take_along_axis(qq, idx[:, None], axis=1)[:, 0]
    return float(np.mean((qq.max(1) - chosen) ** 2))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--top", type=int, default=500)
    ap.add_argument("--lam", type=float, default=300.0)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[0.01, 0.1, 0.3, 1.0, 3.0, 10.0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    datasets = {}
    if (DATA / "ml-100k" / "u.data").exists():
        datasets["ml-100k"] = E.interaction_matrix(E.read_ml100k(DATA / "ml-100k" / "u.data"))
    if (DATA / "amazon-games" / "Video.txt").exists():
        datasets["amazon-games"] = E.interaction_matrix(E.read_pairs(DATA / "amazon-games" / "Video.txt"),
                                                        max_items=3000)
    if not datasets:
        raise SystemExit("no datasets found under ../shared/datasets")
    rows, curves, info = [], {}, {}
    for name, x in datasets.items():
        q, d, _, _ = E.selection_problems(x, lam=args.lam, top=args.top, users=args.users, seed=args.seed)
        rho = np.asarray(S.spearman(q, d))
        info[name] = {"users_total": int(x.shape[0]), "items": int(x.shape[1]), "interactions": int(x.sum()),
                      "users_evaluated": int(q.shape[0]), "candidates": int(q.shape[1]),
                      "spearman_quantiles": dict(zip(["5", "25", "50", "75", "95"],
                                                     map(float, np.percentile(rho, [5, 25, 50, 75, 95])))),
                      "spearman_histogram": np.histogram(rho, bins=20, range=(-1, 1))[0].tolist()}
        curves[name] = {}
        for mech in tqdm(EXACT + SAMPLED, desc=name):
            ys = []
            for eps in args.epsilons:
                if mech in EXACT:
                    y = float(np.mean(np.concatenate([
                        SC.expected_squared_error(S.probabilities(mech, q[i:i + 8], d[i:i + 8], eps), q[i:i + 8])
                        for i in range(0, len(q), 8)])))
                else:
                    y = mc_mse(mech, q, d, eps, args.draws, args.seed)
                ys.append(y)
                rows.append(dict(dataset=name, mechanism=mech, epsilon=eps, mse=y,
                                 method="exact" if mech in EXACT else f"monte-carlo({args.draws}/user)"))
            curves[name][mech] = ys
    png = RESULTS_DIR / "selection_recommendation.png"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(datasets), figsize=(5 * len(datasets), 7), squeeze=False)
    for j, name in enumerate(datasets):
        for mech, ys in curves[name].items():
            axes[0, j].plot(args.epsilons, ys, ":" if "nonprivate" in mech else "-", marker=".", label=mech)
        axes[0, j].set(xscale="log", yscale="log", xlabel="ε", ylabel="MSE", title=name)
        axes[1, j].bar(np.linspace(-0.95, 0.95, 20), info[name]["spearman_histogram"], width=0.09)
        axes[1, j].set(xlabel="per-user Spearman(score, sensitivity)", ylabel="users")
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    best = {n: {f"eps={e}": min((c[i], m) for m, c in curves[n].items() if "nonprivate" not in m)[1]
                for i, e in enumerate(args.epsilons)} for n in curves}
    path = write_results("selection_recommendation", rows, command=" ".join(["PYTHONPATH=. python -m benchmarks.selection.recommendation"] + sys.argv[1:]), datasets=info, curves=curves, epsilons=args.epsilons,
                         best_private_mechanism=best, lam=args.lam, top=args.top,
                         sensitivities="5%-95% spread of predicted scores across users, declared public",
                         plot=png.name)
    for n, b in best.items():
        print(n, b)
    print("wrote", path)


if __name__ == "__main__":
    main()
