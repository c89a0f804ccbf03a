"""Privacy audit: the ε each routine reports beside an empirical lower bound from canaries (`jdp.audit`), for the
honest routines and for deliberately broken variants (which the audit must catch).

    PYTHONPATH=. python -m benchmarks.privacy.audit [--quick] [--render-only]

writes benchmarks/privacy/results/privacy_audit.json and its section of benchmarks/privacy/README.md (between the audit
markers; then run
`python -m benchmarks.render_readme`). A benchmark, not a test: the numbers are lower bounds at 95% confidence
from fixed seeds; tests/privacy/test_audit.py asserts the same properties at smaller sizes.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
from tqdm.auto import tqdm

from benchmarks.common import current_names, results_dir, write_results
from jdp import selection as S
from jdp.altmin import AltMinConfig
from jdp.audit.altmin import audit_altmin
from jdp.audit.dp_sgd import DPSGDAuditConfig, audit_dp_sgd, old_engine_available
from jdp.audit.selection import default_instances, exact_audit, sampled_audit

RESULTS_DIR = results_dir(__file__)

NAME = "privacy_audit"
SECTION = pathlib.Path(__file__).resolve().parent / "README.md"
START, END = "<!-- audit:start -->", "<!-- audit:end -->"
CONFIDENCE = 0.95


def _cases(quick: bool):
    """(group, label, thunk) for every audited routine and broken variant."""
    f = 0.2 if quick else 1.0
    cfg = DPSGDAuditConfig(epsilon=2.0, delta=1e-5, steps=2, sampling_rate=1.0)
    poisson = DPSGDAuditConfig(epsilon=2.0, delta=1e-5, steps=8, sampling_rate=0.25)
    runs = int(2_000_000 * f)
    m, m_grad, m_input = 4096, int(16384 * f), int(4096 * f)
    high = DPSGDAuditConfig(epsilon=8.0, delta=1e-5, steps=2, sampling_rate=1.0)
    out = [
        ("dp-sgd", "gradient canaries, one run, q = 1, 2 steps",
         lambda: audit_dp_sgd(jax.random.key(11), cfg, seed=0, canary="gradient", canaries=m_grad)),
        ("dp-sgd", "gradient canaries, one run, q = 0.25, 8 steps",
         lambda: audit_dp_sgd(jax.random.key(12), poisson, seed=0, canary="gradient", canaries=m_grad)),
        ("dp-sgd", "gradient canary, many runs",
         lambda: audit_dp_sgd(jax.random.key(13), cfg, seed=0, canary="gradient", mode="many-run", runs=runs)),
        ("dp-sgd", "gradient canary, many runs, ε = 8",
         lambda: audit_dp_sgd(jax.random.key(16), high, seed=0, canary="gradient", mode="many-run", runs=runs)),
        ("dp-sgd", "input canaries (black box), one run",
         lambda: audit_dp_sgd(jax.random.key(14), cfg, seed=0, canary="input", canaries=m_input)),
        ("dp-sgd", "crafted float32-cancellation canaries, one run",
         lambda: audit_dp_sgd(jax.random.key(15), cfg, seed=0, canary="fp-cancel", canaries=m)),
        ("dp-sgd", "gradient canaries, one run",
         lambda: audit_dp_sgd(jax.random.key(11), cfg, seed=0, canary="gradient", canaries=m_grad, variant="no-clip")),
        ("dp-sgd", "input canaries (black box), one run",
         lambda: audit_dp_sgd(jax.random.key(14), cfg, seed=0, canary="input", canaries=m_input, variant="no-clip")),
        ("dp-sgd", "gradient canaries, one run",
         lambda: audit_dp_sgd(jax.random.key(11), cfg, seed=0, canary="gradient", canaries=m_grad, variant="half-noise")),
        ("dp-sgd", "gradient canary, many runs",
         lambda: audit_dp_sgd(jax.random.key(13), cfg, seed=0, canary="gradient", mode="many-run", runs=runs,
                              variant="half-noise")),
    ]
    if old_engine_available():
        out.append(("dp-sgd", "crafted float32-cancellation canaries, one run",
                    lambda: audit_dp_sgd(jax.random.key(15), cfg, seed=0, canary="fp-cancel", canaries=m,
                                         variant="old-engine")))
    inst = default_instances(n=int(200 * f), seed=0)
    draws = int(1_000_000 * f)
    for name in sorted(S.PRIVATE_MECHANISMS):
        out.append(("selection", "exact, worst-case neighbours", lambda name=name: exact_audit(name, 1.0, *inst)))
    for name in ("krr", "pf", "em", "gem", "rs-geometric"):
        out.append(("selection", "sampler",
                    lambda name=name: sampled_audit(name, 1.0, jax.random.key(21), draws, *inst)))
    out += [
        ("selection", "exact, worst-case neighbours", lambda: exact_audit("rnmh-nonprivate", 1.0, *inst)),
        ("selection", "exact, worst-case neighbours", lambda: exact_audit("em", 1.0, *inst, variant="half-noise")),
        ("selection", "exact, worst-case neighbours",
         lambda: exact_audit("pf", 1.0, *inst, variant="monotone-misdeclared")),
        ("selection", "sampler",
         lambda: sampled_audit("em", 1.0, jax.random.key(22), draws, *inst, variant="half-noise")),
    ]
    alt = dict(epsilon=2.0, budget=8, show_progress=False)
    n_runs = 1 if quick else 10
    for method in ("ada-dpals", "ada-dpsgd"):
        out.append(("altmin", f"canary users, {n_runs} × 400 pooled",
                    lambda method=method: audit_altmin(AltMinConfig(method=method, **alt), canaries=400,
                                                       runs=n_runs, seed=0)))
    out.append(("altmin", "canary users, 400",
                lambda: audit_altmin(AltMinConfig(method="ada-dpals", **alt), canaries=400, variant="no-noise", seed=0)))
    return out


def _fmt(x: float) -> str:
    return "∞" if x == float("inf") else f"{x:.4f}"


def render(payload: dict) -> str:
    rows = payload["results"]
    lines = [
        "## Privacy audit: reported ε beside an empirical lower bound",
        "",
        f"`{payload['command']}` → `benchmarks/privacy/results/{NAME}.json` (commit {payload['git_commit'][:7]}"
        f"{' with uncommitted changes in the tree' if payload['git_commit'].endswith('-dirty') else ''}, "
        f"{payload['device']}, {payload['date'][:10]}, {payload['seconds']:.0f} s). "
        + (payload["note"] + " " if payload.get("note") else "") + "`jdp.audit` runs each routine "
        "as implemented on canaries and turns the attacker's success into a lower bound on ε at 95% confidence "
        "(one run: Steinke, Nasr & Jagielski 2023, m canaries each in w.p. ½, Bonferroni over the guess counts "
        "tried; many runs: Clopper–Pearson on a held-out half; selection: exact log-ratios of `probabilities` on "
        "worst-case neighbours, no sampling). A bound above the reported ε is a bug; one below says nothing more "
        "than that this attack did not find one. The broken variants are there to show that the audit can fail: "
        "`no-clip` (clipping at 10⁶·C, noise still σ·C), `half-noise` (σ/2, or the selection law at 2ε), "
        "`old-engine` (the clipping engine without the floating-point bound of its norms, `_FP_BOUND = False`, "
        "against the crafted float32-cancellation example of #69 item 1), `monotone-misdeclared` (RNM/EM/PF's "
        "monotone form on scores that move both ways), RNMH (not private) and altmin's non-private `als` fitted "
        "while the private method's ε is reported (`no-noise`). DP-SGD: ε = 2, full batches (q = 1) and 2 steps "
        "unless the row says otherwise, δ = 1e-5, C = 1, σ from the RDP accountant; "
        "selection: ε = 1 (reported: the mechanism's `privacy_report`); altmin: ε = 2, δ = 1e-5, "
        "budget 8, tiny planted data (300 users, 40 items) plus canary users each rating 8 items of their own at "
        "the top of the scale (score: the released item biases, rank 0 at this size).",
        "",
        "| routine | audit | variant | reported ε | audited lower bound | caught | canaries / runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = r["setting"].get("runs", 1)
        if r["method"] == "one-run":
            size = f"{r['canaries']:,} canaries" + (f" in {runs} runs" if runs > 1 else "")
        elif r["method"] == "many-run":
            draws = r["setting"].get("draws")
            size = f"{r['runs_in'] + r['runs_out']:,} runs" if draws is None else f"{draws:,} × 2 draws"
        else:
            size = f"{r['instances']} instances × {r['neighbours'] // r['instances']} neighbours"
        caught = "**yes**" if r["violated"] else "no"
        lines.append(f"| {r['routine_name']} | {r['audit']} | {r['variant']} | {_fmt(r['reported_epsilon'])} | "
                     f"{_fmt(r['epsilon_lower_bound'])} | {caught} | {size} |")
    honest = [r for r in rows if r["variant"] == "honest"]
    broken = [r for r in rows if r["variant"] != "honest"]
    missed = [f"{r['routine_name']} {r['variant']} ({r['audit']})" for r in broken if not r["violated"]]
    lines += ["", f"Every honest routine stays at or below its reported ε ({sum(not r['violated'] for r in honest)} "
              f"of {len(honest)}); the audit catches {sum(r['violated'] for r in broken)} of {len(broken)} broken "
              "variants" + (f" (missed: {'; '.join(missed)}: the one-run audit is too weak for a factor of 2 in "
                            "the noise, the many-run audit catches it)" if missed else "") + ". The gaps are expected, not slack in the accounting: a one-run audit of a Gaussian "
              "mechanism reaches only a fraction of ε (the guessing game is the pure-DP worst case), the "
              "many-run audit needs ~1/δ runs to reach the tail where ε is attained, black-box input canaries "
              "see the update through the model's loss only, and altmin's released item biases are shrunk "
              "towards a prior (the SSP methods' far more than noisy GD's). Selection audits are exact: "
              "kRR, permute-and-flip and RNM-exp attain ε on tied or one-leader instances, GEM-family and "
              "random-stopping mechanisms stay well below it on these instances."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--render-only", action="store_true", help="re-render the section from the JSON")
    parser.add_argument("--note", default=None, help="a sentence about the run, kept in the JSON and the section")
    args = parser.parse_args()
    path = RESULTS_DIR / f"{NAME}.json"
    if not args.render_only:
        t0 = time.perf_counter()
        rows = []
        for group, audit, thunk in tqdm(_cases(args.quick), desc="audits"):
            ts = time.perf_counter()
            a = thunk()
            row = {"group": group, "routine_name": a.routine.split(" (")[0], "audit": audit,
                   "seconds": time.perf_counter() - ts, **a.to_dict()}
            row["routine_name"] = {"dp-sgd": "DP-SGD"}.get(row["routine_name"], row["routine_name"])
            rows.append(row)
            tqdm.write(f"{a.routine} [{a.variant}]: reported {a.reported_epsilon:.3f}, lower bound "
                       f"{a.epsilon_lower_bound:.3f}{'  VIOLATED' if a.violated else ''}")
        write_results(NAME, rows, confidence=CONFIDENCE, quick=args.quick, seconds=time.perf_counter() - t0,
                      old_engine_available=old_engine_available())
    payload = json.loads(path.read_text())
    if args.note is not None:
        payload["note"] = args.note
        path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    text = SECTION.read_text()
    head, tail = text.split(START)[0], text.split(END, 1)[1]
    SECTION.write_text(head + START + "\n" + current_names(render(payload)).rstrip("\n") + "\n" + END + tail)
    print("wrote", path, "and", SECTION)


if __name__ == "__main__":
    main()
