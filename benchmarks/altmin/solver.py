"""Quality of the private item solve: Cholesky with an adaptive ridge (`jdp.multitask.ssp.ridge_solve`)
against the PSD projection by eigendecomposition that it replaced, same data, seeds and noise.

The old solve, θ = V diag(1/(max(e, 0) + λ)) Vᵀ b̂ from eigh(Â), is kept here only as the baseline.
Both see the same noisy Gram (same key), so the test RMSEs differ only through the solver.

    PYTHONPATH=. python -m benchmarks.altmin.solver            # ML-100K (if present) + synthetic MovieLens
    PYTHONPATH=. python -m benchmarks.altmin.solver --quick
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_results
from jdp.altmin import AltMinConfig
from jdp.altmin.experiment import rating_experiment
from jdp.data import load_movielens, planted_movielens
from jdp.multitask import ssp

ML100K = pathlib.Path(__file__).resolve().parents[3] / "shared" / "datasets" / "ml-100k" / "u.data"
CHOLESKY = ssp.ridge_solve


def psd_eigh_solve(a, b, lam, adaptive=False, lapack=True):
    """The replaced private solve: PSD projection and ridge from one eigendecomposition."""
    if not adaptive:
        return CHOLESKY(a, b, lam, adaptive, lapack)
    e, v = jnp.linalg.eigh(0.5 * (a + jnp.swapaxes(a, 1, 2)))
    return jnp.einsum("tij,tj->ti", v, jnp.einsum("tji,tj->ti", v, b) / (jnp.maximum(e, 0.0) + lam))


def run(data, name, rating_range, settings, seeds):
    rows = []
    for solver, fn in (("cholesky-adaptive-ridge", CHOLESKY), ("eigh-psd-projection", psd_eigh_solve)):
        ssp.ridge_solve = fn
        jax.clear_caches()  # the jitted solve traced the other solver
        for eps, reg_scale in settings:
            for seed in seeds:
                cfg = AltMinConfig(method="ada-dpals", epsilon=eps, reg_scale=reg_scale, rating_range=rating_range,
                                   n_shards=1, show_progress=False)
                row = rating_experiment(data, cfg, seed=seed)
                m = row["metrics"]
                rows.append({"data": name, "solver": solver, "epsilon": eps, "reg_scale": reg_scale, "seed": seed,
                             "dim": row["config"]["dim"], "rmse_test": m["rmse_test"],
                             "rmse_tail_bucket": m["sliced"]["rmse_test"][0]})
                print(rows[-1], flush=True)
    ssp.ridge_solve = CHOLESKY
    return rows


def summarize(rows):
    out = []
    for key in sorted({(r["data"], r["epsilon"], r["reg_scale"]) for r in rows}):
        cell = {"data": key[0], "epsilon": key[1], "reg_scale": key[2]}
        for solver in ("cholesky-adaptive-ridge", "eigh-psd-projection"):
            rs = [r for r in rows if (r["data"], r["epsilon"], r["reg_scale"], r["solver"]) == (*key, solver)]
            cell[solver] = {"rmse_test_mean": float(np.mean([r["rmse_test"] for r in rs])),
                            "rmse_test_std": float(np.std([r["rmse_test"] for r in rs])),
                            "rmse_tail_mean": float(np.mean([r["rmse_tail_bucket"] for r in rs])), "n_seeds": len(rs)}
        out.append(cell)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    seeds = list(range(args.seeds))
    settings = [(1.0, 2.0), (5.0, 2.0), (1.0, 0.5)]  # default ridge, and a small one (Â often indefinite)
    rows = []
    if ML100K.exists() and not args.quick:
        rows += run(load_movielens(ML100K), "ml-100k", (1.0, 5.0), settings, seeds)
    size = (2_000, 500, 60_000) if args.quick else (20_000, 2_000, 1_000_000)
    synth = planted_movielens(seed=0, n_users=size[0], n_items=size[1], nnz=size[2]).data
    rows += run(synth, f"synthetic-movielens {size[0]}x{size[1]}, {size[2]} ratings", (0.5, 5.0), settings, seeds)
    summary = summarize(rows)
    for s in summary:
        print(s)
    path = write_results("altmin_solver" + ("_quick" if args.quick else ""), rows, summary=summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
