"""Timing of jdp.data at MovieLens scale: planted_powerlaw at ML10M / ML20M size, planted_movielens at ML10M
size (with its marginals beside the published ML10M ones) and the MovieLens readers.

Run: PYTHONPATH=. python -m benchmarks.data.generation [--read-rows 5000000]
Writes benchmarks/data/results/data_generation.json. Peak memory is the process's max RSS after each step
(monotone over the run, so later rows include earlier peaks).
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
import pathlib

import numpy as np

from benchmarks.common import write_results
from jdp.data import load_movielens, planted_movielens, planted_powerlaw

SIZES = {"ml10m": (69_878, 10_677, 10_000_000), "ml20m": (136_677, 20_108, 10_000_000)}
RUNS = [(planted_powerlaw, "ml10m"), (planted_powerlaw, "ml20m"), (planted_movielens, "ml10m")]
# Published ML10M marginals for comparison (LensKit's ML10M description; item median from its log-normal fit).
ML10M_PUBLISHED = {"item_gini": 0.805, "max_item_count": 34_864, "median_item_count_fit": 141, "min_user_count": 20}


def _gini(x: np.ndarray) -> float:
    x = np.sort(x.astype(np.float64))
    return float((2 * np.arange(1, x.size + 1) - x.size - 1) @ x / (x.size * x.sum()))


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


def _write(path: pathlib.Path, fmt: str, user, item, rating, ts) -> None:
    import pandas as pd
    df = pd.DataFrame({"userId": user + 1, "movieId": item + 1, "rating": rating, "timestamp": ts})
    if fmt == "csv":
        df.to_csv(path, index=False, float_format="%g")
    else:  # '::' separated: join as strings (to_csv only takes a 1-character separator)
        lines = (df["userId"].astype(str) + "::" + df["movieId"].astype(str) + "::" + df["rating"].map("{:g}".format)
                 + "::" + df["timestamp"].astype(str))
        path.write_text("\n".join(lines.tolist()) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--read-rows", type=int, default=5_000_000)
    args = ap.parse_args()
    rows = []
    data = None
    for generate, name in RUNS:
        n_users, n_items, nnz = SIZES[name]
        t = time.perf_counter()
        s = generate(seed=0, n_users=n_users, n_items=n_items, nnz=nnz)
        dt = time.perf_counter() - t
        c = np.sort(s.data.item_counts())[::-1]
        uc = s.data.user_counts()
        row = {"task": generate.__name__, "size": name, "n_users": n_users, "n_items": n_items,
               "nnz": s.data.nnz, "seconds": round(dt, 2), "peak_rss_gb": round(_peak_gb(), 3),
               "top10pct_item_share": round(float(c[: n_items // 10].sum() / c.sum()), 4),
               "max_item_count": int(c[0]), "median_item_count": float(np.median(c)), "min_item_count": int(c[-1]),
               "items_below_10_ratings": round(float((c < 10).mean()), 4), "item_gini": round(_gini(c), 4),
               "median_user_count": float(np.median(uc)), "min_user_count": int(uc.min()), "user_gini": round(_gini(uc), 4),
               "rating_mean": round(float(s.data.rating.mean()), 4), "rating_std": round(float(s.data.rating.std()), 4)}
        print(row, flush=True)
        rows.append(row)
        if generate is planted_powerlaw:
            data = s.data
    n = min(args.read_rows, data.nnz)
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(data.nnz, n, replace=False))
    ts = rng.integers(789_652_009, 1_427_784_002, n)
    rating = np.round(data.rating[idx] * 2) / 2
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, fname in (("colons", "ratings.dat"), ("csv", "ratings.csv")):
            path = pathlib.Path(tmp) / fname
            _write(path, fmt, data.user[idx], data.item[idx], rating, ts)
            t = time.perf_counter()
            d = load_movielens(path)
            dt = time.perf_counter() - t
            assert d.nnz == n
            row = {"task": "load_movielens", "format": fname, "rows": n, "seconds": round(dt, 2),
                   "rows_per_second": round(n / dt), "file_mb": round(path.stat().st_size / 1e6, 1),
                   "peak_rss_gb": round(_peak_gb(), 3)}
            print(row, flush=True)
            rows.append(row)
            path.unlink()
    write_results("data_generation", rows, ml10m_published=ML10M_PUBLISHED,
                  command=f"PYTHONPATH=. python -m benchmarks.data.generation --read-rows {args.read_rows}")


if __name__ == "__main__":
    main()
