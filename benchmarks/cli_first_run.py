"""Time to first result: each CLI's smallest documented run, wall time of a whole process, first with an
empty compilation cache (what a new user waits) and then again with the cache the first run filled.

    PYTHONPATH=. python -m benchmarks.cli_first_run [--data-dir DIR]

`--data-dir`: a jdp data cache that already holds ml-100k (else that row needs the network and is skipped
when the download fails). Writes benchmarks/results/cli_first_run.json. Target: ≤ 10 s per first run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import write_results

RUNS = [
    ("altmin", ["altmin", "--data", "synthetic"]),
    ("altmin ml-100k", ["altmin", "--data", "ml-100k", "--method", "ada-dpals", "--epsilon", "5"]),
    ("seqrec", ["seqrec", "--data", "synthetic"]),
    ("select run", ["select", "run", "--mechanism", "mgem", "--epsilon", "0.5", "--scenario", "bimodal-positive",
                    "--problems", "10000", "--k", "100"]),
    ("select curves", ["select", "curves", "--scenario", "polarised-strong", "--k", "100", "--trials", "32"]),
    ("meta", ["meta", "--n-tasks", "100"]),
]


def wall(cmd: list[str], env: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jdp.cli", *cmd], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return time.perf_counter() - t0, proc.returncode


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="names of RUNS to time (default: all)")
    args = ap.parse_args(argv)
    rows = []
    for name, cmd in RUNS:
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as work:
            env = dict(os.environ, JDP_COMPILATION_CACHE=cache)
            if args.data_dir:
                env["JDP_DATA"] = args.data_dir
            full = cmd + ["--out", os.path.join(work, "run.json")]
            first, rc1 = wall(full, env)
            second, rc2 = wall(full, env)
        row = {"name": name, "command": "jdp " + " ".join(cmd), "first_run_seconds": first,
               "second_run_seconds": second, "returncodes": [rc1, rc2], "target_seconds": 10.0}
        rows.append(row)
        print(f"{name:16s} first {first:6.1f} s  second (compilation cached) {second:6.1f} s  rc {rc1},{rc2}", flush=True)
    path = write_results("cli_first_run", rows, command="PYTHONPATH=. python -m benchmarks.cli_first_run"
                         + (" --data-dir <cache>" if args.data_dir else ""),
                         note="wall time of the whole process (interpreter start, imports, data, compilation, run); "
                              "first: empty JDP_COMPILATION_CACHE; second: the cache the first run filled")
    print("wrote", path)


if __name__ == "__main__":
    main()
