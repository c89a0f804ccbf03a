"""Plots of the CLIs' JSON results (`--plot run.png`); matplotlib is the optional extra `plots`
(`pip install -e ".[plots]"` in a checkout).

One function per result kind, each taking the dict a CLI writes with `--out` and a path; `save_plot`
picks the function from the command. Plots only show released values (and the non-private references
the run states as such).
"""
from __future__ import annotations

import pathlib
from typing import Callable


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or the checkout's extra: "
                          "pip install -e '.[plots]')") from None
    matplotlib.use("Agg")  # files only: works without a display (CI, servers)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def altmin_run(row: dict, path) -> pathlib.Path:
    """Test RMSE per item-popularity bucket (0 = tail) beside the zero-cost and prior-only baselines."""
    plt = _pyplot()
    m = row["metrics"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    buckets = m["sliced"]["rmse_test"]
    ax.bar(range(len(buckets)), buckets, color="tab:blue", label=f"{row['method']} (ε={row['epsilon']})")
    for key, style, label in (("rmse_zero_cost_test", "--", "zero-cost: own bias + public prior"),
                              ("rmse_prior_only_test", ":", "public prior only")):
        if m.get(key) is not None:
            ax.axhline(m[key], color="k", linestyle=style, label=f"{label} ({m[key]:.3f})")
    ax.set_xlabel("item popularity bucket (0 = tail)")
    ax.set_ylabel("test RMSE")
    ax.set_title(f"overall test RMSE {m['rmse_test']:.3f}")
    ax.set_ylim(bottom=min(buckets + [m.get("rmse_zero_cost_test") or buckets[0]]) * 0.9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def seqrec_history(out: dict, path) -> pathlib.Path:
    """Training loss and (when evaluated) validation NDCG@10 per epoch."""
    plt = _pyplot()
    history = out.get("history") or []
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    loss = [(h["epoch"], h["train_loss"]) for h in history if "train_loss" in h]
    ndcg = [(h["epoch"], 100 * h["ndcg_at_10_valid"]) for h in history if "ndcg_at_10_valid" in h]
    for a, pts, label in ((ax[0], loss, "train loss (private diagnostic)"), (ax[1], ndcg, "valid NDCG@10 %")):
        if pts:
            a.plot(*zip(*pts), marker="o")
        a.set_xlabel("epoch")
        a.set_title(label)
    fig.suptitle(f"{out.get('model')} ε={out.get('epsilon')}")
    return _save(fig, path)


def seqrec_release(out: dict, path) -> pathlib.Path:
    """Test NDCG@10 of a model without training curve (`jdp seqrec --model transitions`) beside the baselines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    baselines = out.get("baselines", {})
    names = [f"{out.get('model')} (ε={out.get('epsilon')})", *baselines]
    values = [out["metrics"]["ndcg_at_10_test"], *(b.get("ndcg_at_10_test", 0.0) for b in baselines.values())]
    ax.bar(names, [100 * v for v in values], color=["tab:blue"] + ["tab:gray"] * (len(values) - 1))
    ax.set_ylabel("test NDCG@10 %")
    ax.set_title(f"{out.get('data')}: one release vs what users get without it")
    return _save(fig, path)


def meta_run(out: dict, path) -> pathlib.Path:
    """Transfer risk of the meta-model beside local training (each test task alone: no release)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    eps = out.get("epsilon_target")
    labels = [f"{out['algorithm']}" + (f" (ε={eps})" if eps is not None else ""), "local training (zero-cost)"]
    ax.bar(labels, [out["transfer_risk"], out["local_training_risk"]], color=["tab:blue", "tab:gray"])
    ax.set_ylabel("transfer risk on test tasks")
    ax.set_title(f"{out['setting']}, K = {out['n_tasks']} tasks")
    return _save(fig, path)


def select_curves(out: dict, path) -> pathlib.Path:
    """Expected squared error of the selected score against ε, one line per mechanism (privacy-utility)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, curve in out["mse"].items():
        ax.plot(out["epsilons"], curve, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ε")
    ax.set_ylabel("expected squared error")
    ax.set_title(f"{out['scenario']}, k = {out['k']}, {out['trials']} problems")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def select_run(out: dict, path) -> pathlib.Path:
    """How often each candidate was selected over all rows of the run."""
    plt = _pyplot()
    import numpy as np
    picks = np.asarray(out["selections"]).ravel()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist(picks, bins=min(50, max(int(picks.max(initial=0)) + 1, 1)), color="tab:blue")
    ax.set_xlabel("selected candidate")
    ax.set_ylabel("rows")
    ax.set_title(f"{out['mechanism']} at ε={out['epsilon']}")
    return _save(fig, path)


PLOTS: dict[str, Callable[[dict, object], pathlib.Path]] = {
    "altmin": altmin_run, "seqrec": seqrec_history, "meta": meta_run, "select curves": select_curves,
    "select run": select_run,
}


def save_plot(command: str, result: dict, path) -> pathlib.Path:
    """Writes the plot of `command`'s result (a key of PLOTS) to `path`."""
    if command not in PLOTS:
        raise ValueError(f"no plot for {command!r}; plots exist for {sorted(PLOTS)}")
    return PLOTS[command](result, path)


__all__ = ["PLOTS", "altmin_run", "meta_run", "save_plot", "select_curves", "select_run", "seqrec_history"]
