"""Writes benchmarks/README.md, the one-screen summary, from the result files (no number in it is typed by hand).

    python -m benchmarks.render_readme            # rewrite benchmarks/README.md
    python -m benchmarks.render_readme --check    # exit 1 when the committed README is not the rendered one

Each capability has its folder (benchmarks/<capability>/: scripts, results/, README.md with the tables and the
commands, NOTES.md with what was tried); the summary takes one or two headline rows from each folder's results/.
The "paper" column quotes the papers (cited under the table); every "ours" cell is read from the JSON named in it.
"""
from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

# (folder, title) in the order the summary lists them
CAPABILITIES = [
    ("altmin", "DP alternating minimization and multi-task SSP"),
    ("clipping", "fast per-example clipping"),
    ("seqrec", "DPFormer: DP sequential recommendation"),
    ("selection", "private selection with heterogeneous sensitivities"),
    ("meta", "task-level DP meta-learning"),
    ("privacy", "accounting and the privacy audit"),
    ("data", "data generation and readers"),
    ("cli", "time to a first result"),
]

# Numbers the papers publish (quoted, not measured here); "—" where a paper gives none.
PAPER = {
    "clipping_ratio": "≈ 1.47 (V100; DPFormer paper)",
    "seqrec_eps8": "1.98 / 1.54 (DPFormer paper, Table 2)",
}


def _load(cap: str, name: str) -> dict:
    return json.loads((HERE / cap / "results" / name).read_text())


def _src(cap: str, *names: str) -> str:
    return ", ".join(f"[{n}]({cap}/results/{n})" for n in names)


def _altmin() -> list[tuple]:
    name = "altmin_quality_ml_100k_defaults.json"
    rows = _load("altmin", name)["summary"]

    def rmse(label, eps):
        return next(r["rmse_test_mean"] for r in rows if r["label"] == label and r["epsilon"] == eps)

    zero = next(r["rmse_zero_cost_mean"] for r in rows if r["label"] == "ada-dpals" and r["epsilon"] == 1.0)
    ours = (f"AdaDPALS {rmse('ada-dpals', 1.0):.4f}, AdaDPSGD {rmse('ada-dpsgd', 1.0):.4f}; zero-cost model "
            f"{zero:.4f}, non-private ALS {rmse('non-private ALS, tuned on validation', None):.4f}")
    return [("test RMSE, MovieLens-100K, ε = 1 (user-level), library defaults", "—", ours, _src("altmin", name))]


def _clipping() -> list[tuple]:
    out = []
    name = "clipping_chunked_b1024_onepiece.json"  # the current engine (chunks of 4 at this vocabulary)
    rows = {r["method"]: r for r in _load("clipping", name)["results"]}
    dp, base = rows["jdp-auto"], rows["nonprivate"]
    out.append(("DP step ÷ non-private step, DPFormer-size model (vocab 23,715), B = 1024", PAPER["clipping_ratio"],
                f"{dp['step_seconds'] / base['step_seconds']:.2f} at "
                f"{dp['peak_memory_bytes'] / base['peak_memory_bytes']:.3f}× the memory (2-core CPU)",
                _src("clipping", name)))
    name = "clipping_b256_jax_privacy.json"
    rows = {r["method"]: r for r in _load("clipping", name)["results"]}
    speedup = rows["jax_privacy"]["step_seconds"] / rows["jdp-auto"]["step_seconds"]
    out.append(("speed-up over jax_privacy's clipped gradient (same model, B = 256)", "—", f"{speedup:.1f}×",
                _src("clipping", name)))
    return out


def _seqrec() -> list[tuple]:
    names = ["seqrec_amazon_dpformer_eps8_ep100.json", "seqrec_amazon_transformer_eps8_ep100.json"]
    runs = [_load("seqrec", n) for n in names]
    ndcg = " / ".join(f"{100 * r['metrics']['ndcg_at_10_test']:.2f}" for r in runs)
    pop = 100 * runs[0]["baselines"]["popularity"]["ndcg_at_10_test"]
    out = [("NDCG@10 %, Amazon Games, ε = 8, 100 epochs: DPFormer / Transformer", PAPER["seqrec_eps8"],
            f"{ndcg} (popularity of the release {pop:.2f})", _src("seqrec", *names))]
    names = ["seqrec_amazon_dpformer_eps8_ep100_itemstart.json", "seqrec_amazon_transformer_eps8_ep100_itemstart.json"]
    runs = [_load("seqrec", n) for n in names]
    ndcg = " / ".join(f"{100 * r['metrics']['ndcg_at_10_test']:.2f}" for r in runs)
    out.append(("the same, item table started from one transition release (beyond the paper)", "—", ndcg,
                _src("seqrec", *names)))
    # the default since 96db06f: the transition prior (0.85 of ε on its release) and dropout 0.2 (ε = 5 seed 0 stopped
    # at epoch 19.45 of 20)
    per_eps = [[f"seqrec_amazon_dpformer_eps{eps}_ep20_prior_dropout02{seed}.json" for seed in seeds]
               for eps, seeds in ((5, ("_partial", "_seed1")), (8, ("", "_seed1")), (10, ("", "_seed1")))]
    ndcg = " · ".join(" / ".join(f"{100 * _load('seqrec', n)['metrics']['ndcg_at_10_test']:.2f}" for n in names)
                      for names in per_eps)
    out.append(("DPFormer with jdp's defaults (the release also in its logits: transition prior; dropout 0.2), "
                "20 epochs, ε = 5 · 8 · 10, seeds 0 / 1 (beyond the paper)", "1.64 · 1.98 · 1.99 (DPFormer paper, "
                "100 epochs); 1.91 · 2.23 · 2.37 (jdp's transitions model, one release)", ndcg,
                _src("seqrec", *[n for names in per_eps for n in names])))
    # the default of 74e73ac (dropout 0.5; at ε = 8 the σ_T 0.74 runs, its calibration being 0.744)
    per_eps = [[f"seqrec_amazon_dpformer_eps{eps}_ep20_{stem}{seed}.json" for seed in ("", "_seed1")]
               for eps, stem in ((5, "prior"), (8, "prior_n074"), (10, "prior"))]
    ndcg = " · ".join(" / ".join(f"{100 * _load('seqrec', n)['metrics']['ndcg_at_10_test']:.2f}" for n in names)
                      for names in per_eps)
    out.append(("the same with dropout 0.5 (the defaults of 74e73ac), ε = 5 · 8 · 10, seeds 0 / 1",
                "1.64 · 1.98 · 1.99 (DPFormer paper, 100 epochs)", ndcg,
                _src("seqrec", *[n for names in per_eps for n in names])))
    return out


def _selection() -> list[tuple]:
    name = "selection_speed.json"
    ratios = _load("selection", name)["ratios"]["vs_diffprivlib_exponential_reused_k100"]
    speed = ", ".join(f"{m} {ratios[m]:.0f}×" for m in ("mgem", "em", "combined-gem"))
    syn = "selection_synthetic.json"
    checks = [v for per_eps in _load("selection", syn)["orderings"].values() for v in per_eps.values()]
    return [("selections per second ÷ diffprivlib's exponential mechanism (k = 100)", "—", speed,
             _src("selection", name)),
            ("orderings of mechanisms the paper states, synthetic scenarios", "qualitative",
             f"{sum(checks)} of {len(checks)} reproduced", _src("selection", syn))]


def _meta() -> list[tuple]:
    name = "meta_transfer_risk.json"
    res = _load("meta", name)

    def pick(rows):
        return [r for r in rows if r["generator"] == "authors" and r["epsilon"] == 10.0 and r["n_tasks"] == 700
                and r["q"] == 2]

    ours = next(r for r in pick(res["results"]) if r["method"] == "private clustering" and r["sampling"] == "poisson")
    theirs = next(r for r in pick(res["paper_reference"]) if r["method"].startswith("authors' notebook"))
    return [("transfer risk, authors' generator, N = 700 tasks, q = 2, ε = 10 (add/remove one task)",
             f"{theirs['transfer_risk']:.3f} (authors' notebook)", f"{ours['transfer_risk']:.3f}",
             _src("meta", name))]


def _privacy() -> list[tuple]:
    name = "privacy_audit.json"
    rows = _load("privacy", name)["results"]
    honest = [r for r in rows if r["variant"] == "honest"]
    broken = [r for r in rows if r["variant"] != "honest"]
    above = sum(r["violated"] for r in honest)
    return [("empirical lower bound on ε (canaries, 95%) vs the reported ε", "—",
             f"{len(honest) - above} of {len(honest)} honest audits at or below their ε; "
             f"{sum(r['violated'] for r in broken)} of {len(broken)} broken variants caught", _src("privacy", name))]


def _data() -> list[tuple]:
    name = "data_generation.json"
    r = next(r for r in _load("data", name)["results"] if r["task"] == "planted_powerlaw" and r.get("size") == "ml20m")
    return [("generate an ML-20M-size long-tailed rating set (`planted_powerlaw`)", "—",
             f"{r['seconds']:.1f} s, {r['peak_rss_gb']:.2f} GB peak", _src("data", name))]


def _cli() -> list[tuple]:
    name = "cli_first_run.json"
    rows = _load("cli", name)["results"]
    slow = max(rows, key=lambda r: r["first_run_seconds"])
    return [("first run of each command's smallest documented run (empty compilation cache)", "—",
             f"≤ {slow['first_run_seconds']:.1f} s (slowest: `{slow['command']}`; "
             f"target {slow['target_seconds']:.0f} s)",
             _src("cli", name))]


ROWS = {"altmin": _altmin, "clipping": _clipping, "seqrec": _seqrec, "selection": _selection, "meta": _meta,
        "privacy": _privacy, "data": _data, "cli": _cli}

HEADER = """# jdp benchmarks

One folder per capability: its scripts, its `results/` (JSON with the command, git commit, device and library
versions behind every number, and a PNG where a picture helps), a page with the current tables and the commands that
rerun them (`README.md`), and a page of what was tried on the way (`NOTES.md`). Run a script from the repository root
as `PYTHONPATH=. python -m benchmarks.<capability>.<script>`. Speed is reported as ratios against a baseline measured
in the same process; the device of each run is in its JSON and on its page. This page is generated from the result
files by `python -m benchmarks.render_readme`.

"""

FOOTER = """
The paper column quotes DPFormer (Re-Attention, phantom clipping) for the clipping and seqrec rows; the meta row's
reference is the figure the authors' notebook prints (recorded in the result file). Each page shows our numbers
beside the papers' where the papers give them, including where we fall short.
"""


def render() -> str:
    lines = [HEADER.rstrip("\n"), "", "| capability | measure | paper | ours | from |", "|---|---|---|---|---|"]
    for cap, _ in CAPABILITIES:
        for measure, paper, ours, src in ROWS[cap]():
            lines.append(f"| [{cap}]({cap}/README.md) | {measure} | {paper} | {ours} | {src} |")
    lines += ["", "Pages: " + " · ".join(f"[{cap}]({cap}/README.md) ({title}; [notes]({cap}/NOTES.md))"
                                        for cap, title in CAPABILITIES) + "."]
    return "\n".join(lines) + "\n" + FOOTER


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text, path = render(), HERE / "README.md"
    if "--check" in argv:
        same = path.exists() and path.read_text() == text
        print("benchmarks/README.md is up to date" if same else "benchmarks/README.md differs: run "
              "`python -m benchmarks.render_readme`")
        return 0 if same else 1
    path.write_text(text)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
