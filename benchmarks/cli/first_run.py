"""Time to first result: each CLI's smallest documented run, wall time of a whole process, first with an
empty compilation cache (what a new user waits) and then again with the cache the first run filled.

    PYTHONPATH=. python -m benchmarks.cli.first_run [--data-dir DIR]

`--data-dir`: a jdp data cache that already holds ml-100k (else that row needs the network and is skipped
when the download fails). Writes benchmarks/cli/results/cli_first_run.json. Target: ≤ 10 s per first run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import current_names, results_dir, with_nav, write_results

RESULTS_DIR = results_dir(__file__)

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
    ap.add_argument("--render", action="store_true", help="only rewrite README.md from the JSON")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over all commands (each with a fresh cache); the table shows each command's fastest")
    args = ap.parse_args(argv)
    if args.render:
        return render()
    runs = [(name, cmd) for name, cmd in RUNS if not args.only or name in args.only]
    times = {name: ([], [], []) for name, _ in runs}  # first runs, second runs, return codes
    for _ in range(args.repeats):  # rounds, so that a host's drift reaches every command alike
        for name, cmd in runs:
            with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as work:
                env = dict(os.environ, JDP_COMPILATION_CACHE=cache)
                if args.data_dir:
                    env["JDP_DATA"] = args.data_dir
                full = cmd + ["--out", os.path.join(work, "run.json")]
                first, rc1 = wall(full, env)
                second, rc2 = wall(full, env)
            times[name][0].append(first)
            times[name][1].append(second)
            times[name][2].extend([rc1, rc2])
            print(f"{name:16s} first {first:6.1f} s  second (compilation cached) {second:6.1f} s  rc {rc1},{rc2}",
                  flush=True)
    rows = []
    for name, cmd in runs:
        firsts, seconds, rcs = times[name]
        rows.append({"name": name, "command": "jdp " + " ".join(cmd), "first_run_seconds": min(firsts),
                     "second_run_seconds": min(seconds), "first_runs_seconds": firsts, "second_runs_seconds": seconds,
                     "returncodes": rcs, "target_seconds": 10.0})
    if args.only:  # re-measured rows replace theirs, tagged with their own provenance; the table keeps its own
        import json
        from benchmarks.common import provenance
        path = RESULTS_DIR / "cli_first_run.json"
        payload = json.loads(path.read_text())
        now = provenance()
        fresh = {r["name"]: {**r, "git_commit": now["git_commit"], "date": now["date"],
                             "note": f"fastest of {args.repeats} round(s)"} for r in rows}
        payload["results"] = [fresh.get(r["name"], r) for r in payload["results"]]
        path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    else:
        path = write_results("cli_first_run", rows, command="PYTHONPATH=. python -m benchmarks.cli.first_run"
                             + (" --data-dir <cache>" if args.data_dir else ""),
                             note="wall time of the whole process (interpreter start, imports, data, compilation, "
                                  "run); first: empty JDP_COMPILATION_CACHE; second: the cache the first run filled; "
                                  f"fastest of {args.repeats} round(s) over all commands (every round in "
                                  "*_runs_seconds)")
    print("wrote", path)
    render()


def render() -> None:
    """benchmarks/cli/README.md from results/cli_first_run.json."""
    import json
    res = json.loads((RESULTS_DIR / "cli_first_run.json").read_text())
    lines = ["## Time to first result: each command's smallest documented run", "",
             f"`{res['command']}`, commit `{res['git_commit'][:10]}`, {res['device']}. Wall time of the whole "
             "process (interpreter start, imports, data, compilation, run, evaluation, writing the JSON); first "
             "with an empty compilation cache (a new user's first run), then again with the cache it filled "
             "(`JDP_COMPILATION_CACHE`). Target: ≤ 10 s for the first run.", ""]
    rounds = max(len(r.get("first_runs_seconds", [0])) for r in res["results"])
    if rounds > 1:
        lines += [f"Each command's fastest of {rounds} rounds over all commands (each round with a fresh cache; "
                  "the range of the rounds in brackets): this host's speed drifts by ±30% within the hour.", ""]

    def cell(best, every):
        return f"{best:.1f}" + (f" [{min(every):.1f}–{max(every):.1f}]" if len(every) > 1 else "")

    lines += ["| command | first run s | second run s | ≤ 10 s |", "|---|---|---|---|"]
    for r in res["results"]:
        ok = "yes" if r["first_run_seconds"] <= r["target_seconds"] else "MISSED"
        first = cell(r["first_run_seconds"], r.get("first_runs_seconds", [r["first_run_seconds"]]))
        second = cell(r["second_run_seconds"], r.get("second_runs_seconds", [r["second_run_seconds"]]))
        lines.append(f"| `{r['command']}` | {first} | {second} | {ok} |")
    again = [r for r in res["results"] if r.get("git_commit", res["git_commit"]) != res["git_commit"]]
    if again:
        lines += ["", "Re-measured alone (`--only`; the other rows are the run above): " + "; ".join(
            f"{r['name']} at commit `{r['git_commit'][:10]}` ({r['date'][:10]})"
            + (f", {r['note']}" if r.get("note") else "") for r in again) + "."]
    lines += ["", "The table's run: 2026-11-30 at 9ebed0c, an idle host, after three changes measured on it: the rank-0 "
              "altmin fit compiles its item update once instead of twice (c3a6164: the second, empirical-Bayes solve "
              "had a prior-mean array where the first had None; results bit-identical), the `jdp` command skips the "
              "interpreter's teardown once a command has returned (fbae9e1: 0.55-0.65 s of freeing modules and "
              "compiled programs after a seqrec run), and the quick seqrec run trains width 32 at lr 8e-2 (9ebed0c). "
              "The same script on the same host earlier that day at fbae9e1 (the first two changes): altmin "
              "6.8 [6.8-7.8], altmin ml-100k 5.0 [5.0-5.3], seqrec 8.6 [8.6-9.7], select run 2.8, select curves 5.3, "
              "meta 6.1 s; the table before (2026-11-29 at fdaa184, another idle host): altmin 8.2 [8.2-9.0], "
              "altmin ml-100k 5.8 [5.8-7.9], seqrec 8.3 [8.3-10.2], select run 2.8, select curves 4.9, meta 6.0 s, "
              "and on slower hosts (2026-11-27/28, in NOTES.md) seqrec took 10.8-17 s. The quick seqrec run at width 32: "
              "test NDCG@10 0.61-0.63 (seeds 1-3; 0.61-0.62 at width 64, lr 3e-2; the learning rate chosen on "
              "validation over 3e-2, 5e-2, 8e-2 and 0.12), first runs 7.5-7.7 s against 8.3-9.2 s at width 64 in "
              "three interleaved pairs (fresh compilation caches)."]
    lines += ["", "`jdp seqrec --data synthetic` trains a 1-block DPFormer of width 32 (since 159a066 one block; 2 "
              "before, the paper's depth, which `--blocks` keeps for published data; width 64 until 9ebed0c) with DP-SGD for 2 epochs (16 steps of ~256 "
              "users × 20 positions, one compiled shape) and ranks the full catalogue; on a first run most of it is "
              "XLA compiling the clipped step (~4 s), the noisy update (~1.5 s), the initialisation and the ranking, "
              "plus ~2 s of imports and the noise calibration. Its second run (new noise seed, new Re-Attention "
              "release) reuses every compilation: the released variances are inputs of the step, not constants. "
              "`jdp altmin --data synthetic` generates and fits 1M ratings (20,000 users).", ""]
    (RESULTS_DIR.parent / "README.md").write_text(with_nav(current_names("\n".join(lines))) + "\n" + (
        "What was measured and tried on the way to these times (interleaved runs of commits, XLA flags, compilation "
        "beside the calibration): [NOTES.md](NOTES.md).\n"))
    (RESULTS_DIR.parent / "NOTES.md").write_text(NOTES)


NOTES = """# Time to first result: notes

What was measured and tried on the way to the times on [the page](README.md), shortened (the full prose is in the
git history of this page and of `benchmarks/README.md`). Runs are interleaved on one host, compilation cache off,
unless said otherwise; hosts drifted by ±25% within the hour, so only same-session pairs compare.

- **altmin, meta, select curves (2026-11-28; 2f9799b, 54e795b, adadf3d, 389ffc0).** A rank-0 `jdp altmin` compiles
  one class-layout solve instead of five; `jdp meta`'s generators draw flat normals (generation compiles in 1.1 s
  instead of 3.4 s); `select curves`' Laplace CDF and pdf share one exp. Against b0925dc: altmin synthetic
  16.1-17.1 → 8.7-9.2 s, altmin ML-100K 9.6-10.7 → 6.3-7.3 s, select curves 10.5-12.7 → 9.4-10.3 s, meta 13.3 →
  10.8 s; meta under 10 s after 967da98 (replace-one ε beside the evaluation) and 8fd8e47 (training compiled beside
  the calibration). seqrec 12.6 s at 389ffc0, 10.8 s at 3e4bf98 (the DP-SGD state allocated by one compiled
  program). The table before (2026-11-25, 3a025d8, a host ~1.4× faster) had every first run at ≤ 10 s.
- **seqrec's first step ready when the calibration ends (2026-11-28; 8a6204f, 20edd7e, 77b26fa).** The clipped
  accumulation (it does not read σ) is traced before the calibration and compiled beside it, the noisy update as
  soon as σ is known; the quick run trains without dropout (test NDCG@10 0.57-0.61 instead of 0.40-0.45). Five
  pairs: 2.7 s (16%) faster in every pair, the first step's wait 6.2-7.7 s → 0.5-0.7 s; still above 10 s on that
  host (~1.7× slower than the table's).
- **seqrec on a slow host (2026-11-28; 7bbd059, 3343277, b821b92).** 17.2 s first / 11.7 s cached where XLA
  compiled ~2× slower than on the table's host: the ≤ 10 s target holds on some hosts only. No XLA flag beside
  level 1 helped beyond the ±1.5 s spread. The noise of the model's ~40 leaves compiled slowly (XLA copies the
  draw's inverse-erf tail into every leaf's fusion): the draw now goes into a buffer of its own (3343277: noise +
  AdamW 2.1-2.5 → 1.4-1.8 s; `optax.flatten` would give 2.0-2.3 s but the checkpoints and the frozen-rows transform
  hold the tree), and each accounted event is computed once per process (b821b92). The whole run did not move
  measurably there; tracing and compiling the clipped step (~5-6 s) and importing jdp (3 s, 2 s of it scipy via
  dp_accounting) remained.
- **Not kept (2026-11-29, 3014e33):** the run-once programs (initialisation, DP-SGD state) compiled at XLA level 0
  through `compiler_options`: 13.7 s against 14.1 s, within the noise.
- **One block instead of two (2026-11-27, 159a066)** halves the step to compile at no loss on the planted data
  (test NDCG@10 0.396 vs 0.386): first run 14.5-16.7 s → 10.9-12.7 s. Not kept: compiling the clipped step beside
  the calibration and initialisation (on 2 cores the compilations already fill both). XLA level 0 compiles the
  step in 2.6 s instead of 5.9 s but runs it 3× slower (22-28 s in all); level 1 gave 10.0 s against 10.9 s (4
  runs each), so the quick run uses level 1 when the caller sets no `XLA_FLAGS`.
- **Overlapping compilations (2026-11-27, ad49f1b against ef2d707):** the calibration beside the initialisation's
  compilation, the update's and evaluation's beside the first step, the quick run's one chunk clipped in one pass:
  19.4-20.0 s against 21.3-23.7 s (a host ~25% slower), identical metrics. Tracing and compiling the DP step alone
  took 5-7 s (non-private 3 s), imports ~2 s.
"""


if __name__ == "__main__":
    main()
