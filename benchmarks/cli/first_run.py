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

from benchmarks.common import current_names, results_dir, write_results

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
              "and on slower hosts (2026-11-27/28, below) seqrec took 10.8-17 s. The quick seqrec run at width 32: "
              "test NDCG@10 0.61-0.63 (seeds 1-3; 0.61-0.62 at width 64, lr 3e-2; the learning rate chosen on "
              "validation over 3e-2, 5e-2, 8e-2 and 0.12), first runs 7.5-7.7 s against 8.3-9.2 s at width 64 in "
              "three interleaved pairs (fresh compilation caches)."]
    lines += ["", "`jdp seqrec --data synthetic` trains a 1-block DPFormer of width 32 (since 159a066 one block; 2 "
              "before, the paper's depth, which `--blocks` keeps for published data; width 64 until 9ebed0c) with DP-SGD for 2 epochs (16 steps of ~256 "
              "users × 20 positions, one compiled shape) and ranks the full catalogue; on a first run most of it is "
              "XLA compiling the clipped step (~4 s), the noisy update (~1.5 s), the initialisation and the ranking, "
              "plus ~2 s of imports and the noise calibration. Its second run (new noise seed, new Re-Attention "
              "release) reuses every compilation: the released variances are inputs of the step, not constants. "
              "`jdp altmin --data synthetic` generates and fits 1M ratings (20,000 users).", "",
              "seqrec, interleaved runs of two commits on 2026-11-27 (a host ~25% slower than the table's that day: "
              "the same command took 20.5 s first / 12.8 s cached on it at ef2d707): 21.3 / 23.4 / 23.7 s "
              "at ef2d707 against 19.4 / 19.6 / 20.0 s at ad49f1b (the calibration beside the initialisation's "
              "compilation, the update's and the evaluation's compilations beside the first step, the quick run's "
              "one chunk clipped in one pass; identical metrics). Then still above 10 s: tracing and compiling the DP "
              "step alone takes 5-7 s (the non-private step 3 s), imports ~2 s.", "",
              "One block instead of two (159a066) halves the step to compile and is no worse on the planted data "
              "(test NDCG@10 0.396 vs 0.386, same seed). Interleaved on one host (2026-11-27, whose speed drifted "
              "±25% within the hour): 16.7 / 15.4 / 14.5 s first run at 7329ff1 against 12.7 / 11.9 / 10.9 s at "
              "159a066; the table's row then 11.4 s. Tried and not kept: compiling the clipped step beside the noise "
              "calibration and the initialisation (it does not depend on σ; one compilation, checked with "
              "JAX_LOG_COMPILES): 14.8 / 14.7 / 13.8 s before against 15.1 / 13.1 / 15.0 s with it, interleaved: "
              "on 2 cores the compilations already fill both, so running them side by side moves no work off the "
              "critical path. `XLA_FLAGS=--xla_backend_optimization_level=0` compiles the step in 2.6 s instead of "
              "5.9 s but runs it 3× slower (0.8 vs 0.27 s per step): 22–28 s in all; level 1 saved nothing then "
              "(single runs on a host drifting ±25%). Re-measured on 2026-11-27, 4 interleaved runs each, XLA "
              "cache off: default 10.9 s (10.1-11.4), level 1 10.0 s (9.4-10.5; first step 4.7 → 3.9 s, 0.10 s "
              "per step either way), `--xla_llvm_disable_expensive_passes` 10.9 s, both 9.9 s: the quick run "
              "has used level 1 since (when the caller sets no `XLA_FLAGS`).", "",
              "Tried on 2026-11-29 (scratch, on 3014e33) and not kept: compiling the run-once programs (the model's "
              "initialisation, the DP-SGD state's allocation) at XLA optimisation level 0 through `jax.jit`'s "
              "`compiler_options`: the initialisation compiles in 0.53-0.90 s instead of 0.77-0.85 s at the quick "
              "run's level 1 (1.06-1.25 s at the default level), and the whole first run took 13.7 s against 14.1 s "
              "(means of 4 interleaved pairs, ranges 12.0-15.9 and 13.5-14.9 s): within the host's noise. That day's "
              "host ran the first run in 12-16 s at 3014e33, against the table's 10.8 s the day before.", "",
              "Re-measured on 2026-11-28 (`--only seqrec` at 7bbd059, not kept in the table): 17.2 s first / 11.7 s "
              "cached, on a host whose XLA compilation ran ~2× slower than the table's; the same command at d142cc6 "
              "(the table's row) interleaved with 7bbd059, cache off: 16.8 / 17.9 s against 16.8 / 19.2 s, so the "
              "≤ 10 s target holds on some hosts only. Compilation took ~9 s of it (`JAX_LOG_COMPILES`: clipped step "
              "3.4-4.8 s, noisy update 1.7-2.8 s, initialisation 1.1-1.4 s, ranking 0.9 s). XLA flags beside level 1, "
              "two interleaved runs each, cache off, none faster beyond the runs' ±1.5 s spread: level 1 alone "
              "19.2 / 17.6 s, `--xla_cpu_parallel_codegen_split_count=1` 19.4 / 17.1, `=4` 17.2 / 18.7, "
              "`--xla_cpu_use_fusion_emitters=false` 16.5 / 17.4 (`--xla_cpu_disable_loop_unrolling` and "
              "`--xla_cpu_optimize_for_size` are unknown to this jaxlib). Where the noisy update's compilation goes: "
              "the noise of the model's ~40 leaves is one normal draw sliced per leaf (`jdp.noise.add_gaussian_tree`), "
              "and XLA copies the cheap tail of the draw's inverse error function into every leaf's fusion (1.3 s to "
              "compile the noise of such a tree, 0.22 s for the draw alone; an optimization barrier does not survive "
              "to the CPU compiler); Adam over the same tree compiles in 0.7 s, noise + Adam in 3.1 s, and 2.0-2.3 s "
              "with the optimizer flattened to one vector (`optax.flatten`; not adopted: the seqrec chain's "
              "frozen-rows transform and the checkpoints hold the tree). Since 3343277 the draw goes into a buffer of "
              "its own on CPU (a conditional on a key bit whose two branches are the same draw: a fusion boundary XLA "
              "keeps, values unchanged): noise + AdamW for a 36-leaf Transformer compiles in 1.4-1.8 s instead of "
              "2.1-2.5 s, and the quick run's noisy update in 1.4-1.5 s instead of 1.9-2.7 s (two runs each, "
              "2026-11-28); and since b821b92 each accounted event is computed once per process (the report printed "
              "and saved and the last epoch reuse the calibration's check: 11 dp_accounting runs instead of 14, "
              "0.1-0.3 s each). The whole quick run did not measurably move on that day's host (three interleaved "
              "runs each, cache off: 16.0 / 18.6 / 16.7 s before, 15.0 / 17.3 / 18.2 s after; the same host took "
              "15.5-17.3 s for the table's command): on such a host the target is out of reach by ~6 s, most of it "
              "compiling and tracing the clipped step (tracing 1.8 s, compiling 3.5-4.8 s) and importing jdp (3 s, "
              "2 s of it dp_accounting importing scipy, 1 s of which scipy rewriting docstrings).", "",
              "**The first step ready when the calibration ends (2026-11-28, 8a6204f, 20edd7e, 77b26fa).** The "
              "clipped accumulation does not read σ: `jdp.clipping.clipped_accumulate` is the one jitted function "
              "`DPSGD.accumulate` returns for given clipping settings, so `jdp.seqrec.train` traces it for the first "
              "step's chunk shapes (the Poisson sample is known before σ) on abstract parameters before the "
              "calibration starts (both are Python and would take turns on the GIL), compiles it beside the "
              "calibration and the initialisation, and compiles the noisy update on abstract state as soon as σ is "
              "known, beside the state's allocation (a test checks each compiles once). The quick run also trains "
              "without dropout now (2 epochs on a planted first-order rule; `--dropout` keeps the choice): test "
              "NDCG@10 0.57-0.61 instead of 0.40-0.45, and the step without per-user dropout masks compiles faster. "
              "Five interleaved pairs on one host, cache off (`/usr/bin/time`; wall / CPU user s): bbe9d3e 18.8 / "
              "24.9, 17.5 / 23.9, 16.3 / 22.8, 16.5 / 22.5, 16.0 / 22.4 against 15.0 / 22.4, 14.6 / 21.7, 14.9 / "
              "22.1, 14.2 / 20.7, 12.9 / 18.7 with the three commits: 2.7 s (16%) faster in every pair, the first "
              "step's wait 6.2-7.7 s → 0.5-0.7 s. Still above 10 s on this host (~1.7× slower than the table's): "
              "the run uses ~21 s of CPU on 2 cores, most of it XLA compiling (clipped step 3.1-4.1 s, noisy update "
              "1.3-2.7 s, initialisation 1.0-1.3 s, ranking 1.1 s), dp_accounting's RDP at fractional orders in the "
              "calibration (~11 runs of 0.1-0.4 s) and the 16 steps (0.12-0.16 s each). Earlier (above) the same "
              "overlap without the tracing order and the update's early compilation moved nothing.", "",
              "**altmin, meta and select curves (2026-11-28, 2f9799b, 54e795b, adadf3d, 389ffc0).** `jdp altmin` "
              "compiled five class-layout solves (`JAX_LOG_COMPILES`: 1.1-2.0 s each): the user solves of training, "
              "of the validation and test predictions and of the zero-cost model, and the item update. Training "
              "now holds a_u = 1 with a zero column in the predictions' design (same solutions), and designs of at "
              "most three columns (rank 0 or 1 with the user bias and scale) are solved from segment sums without a "
              "class layout, so a rank-0 run compiles one class-layout solve, the item update's. `jdp meta`'s task "
              "generators draw their normals flat and reshape (`jdp.noise.standard_normal`, the same numbers: "
              "jax's threefry counts over the flattened index; XLA on CPU compiles the 3-d sampler in ~0.6 s, the "
              "flat one in ~0.2 s): generation compiled in 1.1 s instead of 3.4 s. `jdp select curves` spends its "
              "time in the exact probabilities' quadratures, not compiling (first and cached runs alike): the "
              "Laplace CDF and pdf now share one exp per entry and random stopping no longer takes exp(log CDF). "
              "Interleaved pairs against b0925dc on one host, cache off (wall s, before → after): altmin synthetic "
              "16.1-17.1 → 8.7-9.2, altmin ML-100K 9.6-10.7 → 6.3-7.3 (3 pairs each), select curves 10.5-12.7 → "
              "9.4-10.3 (3 pairs); meta 13.3 → 10.8 (one run each). seqrec is unchanged by these. The table's previous "
              "run (2026-11-25, commit 3a025d8, one round, a host about 1.4× faster than this one, whose select run "
              "took 2.6 s against 4.3 s here) had every first run at ≤ 10 s: 8.7 / 5.8 / 9.4 / 2.6 / 7.2 / 7.5 s in "
              "the table's order; on today's host seqrec missed the target (12.6 s at 389ffc0; 10.8 s at 3e4bf98, whose "
              "DP-SGD state is allocated by one compiled program instead of an eager op per leaf that competed with "
              "the first step's compilation: 13.5 → 12.2 s mean over 3 interleaved pairs), and meta (10.6 s) until 967da98 (the "
              "report's replace-one ε accounted beside the evaluation, 13.7 → 10.4 s against b0925dc) and 8fd8e47 "
              "(the training program compiled beside the calibration, 10.8 → 9.9 s against 967da98; 3 interleaved "
              "pairs each, cache off): its row is re-measured at 8fd8e47.", ""]
    page, _, log = current_names("\n".join(lines)).partition(NOTES_FROM)
    (RESULTS_DIR.parent / "README.md").write_text(
        page + "What was measured and tried on the way to these times (interleaved runs of commits, XLA flags, "
        "compilation beside the calibration): [NOTES.md](NOTES.md).\n")
    (RESULTS_DIR.parent / "NOTES.md").write_text(NOTES_HEAD + NOTES_FROM + log)


NOTES_FROM = "seqrec, interleaved runs of two commits on 2026-11-27"
NOTES_HEAD = """# Time to first result: notes

What was measured and tried on the way to the times on [the page](README.md); each paragraph
names its commits and host. The page holds the current table.

"""


if __name__ == "__main__":
    main()
