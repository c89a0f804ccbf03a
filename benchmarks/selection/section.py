"""Renders benchmarks/selection/README.md from the selection result files (run after the benchmarks).

    PYTHONPATH=. python -m benchmarks.selection.section
"""
from __future__ import annotations

import json
import pathlib

from benchmarks.common import current_names, with_nav

ROOT = pathlib.Path(__file__).resolve().parent
RES = ROOT / "results"


def _load(name):
    p = RES / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def speed_section(r) -> list[str]:
    out = ["### Speed (`benchmarks/selection/results/selection_speed.json`)", "",
           f"Command: `{r['command']}` — device `{r['device']}`, commit `{r['git_commit']}`, ε = {r['epsilon']}. "
           "All rows come from one process run side by side (absolute numbers drift between runs on this VM; "
           "compare ratios). Timings exclude compilation and include input validation. Every sampler runs in "
           "float64 since 8f21961 (the row maximum is subtracted in float64 and the noise is drawn in float64: a "
           "float32 cast before the mechanism can void ε), which is why the jdp rows are 1.5–3× slower than the "
           "float32 table of 358f4f0 this replaces (e.g. GEM at k = 100: 3.9·10⁵ vs 1.26·10⁶ selections/s).", "",
           "| mechanism | k=10 | k=100 | k=1000 | × diffprivlib EM (k=100, object reused) | × plain jitted argmax+noise (k=100) "
           "| compile s (k=100, 10⁴ problems) |",
           "|---|---|---|---|---|---|---|"]
    best, compile_s = {}, {}
    for row in r["results"]:
        key = (row["mechanism"], row["k"])
        best[key] = max(best.get(key, 0.0), row["selections_per_second"])
        if row["k"] == 100 and row["batch"] == 10_000 and "compile_seconds" in row:
            compile_s[row["mechanism"]] = row["compile_seconds"]
    names = []
    for row in r["results"]:
        if row["mechanism"] not in names:
            names.append(row["mechanism"])
    ratios_d = r["ratios"].get("vs_diffprivlib_exponential_reused_k100", {})
    ratios_p = r["ratios"].get("vs_plain_jax_argmax_k100", {})
    for m in names:
        cells = [f"{best[(m, k)]:.3g}" if (m, k) in best else "-" for k in (10, 100, 1000)]
        rd = f"{ratios_d[m]:.1f}" if m in ratios_d else ("1.0" if m == "diffprivlib-exponential" else "-")
        rp = f"{ratios_p[m]:.2f}" if m in ratios_p else "-"
        cs = f"{compile_s[m]:.2f}" if m in compile_s else "-"
        out.append(f"| {m} | " + " | ".join(cells) + f" | {rd} | {rp} | {cs} |")
    out += ["", "Selections per second, best over the batch sizes run (10⁴–10⁶ problems; diffprivlib and "
            "NumPy rows: their own loop/batch sizes, see the JSON). Compile: the first call of a shape (trace + "
            "compile + one run) minus the steady per-call time; later calls of the same shape reuse it."]
    return out


def synthetic_section(r) -> list[str]:
    eps = r["epsilons"]
    i01, i1 = eps.index(0.1), eps.index(1.0)
    out = ["### Synthetic scenarios (`benchmarks/selection/results/selection_synthetic.json`, `selection_synthetic.png`)", "",
           f"Command: `{r['command']}`; k = {r['k']}, {r['trials']} problems per scenario, exact probabilities "
           "(noise-free MSE). Scenario distributions are our design (the paper's were not recoverable).", "",
           "| scenario | mean Spearman | " + " | ".join(f"{m} (ε=0.1 / 1)" for m in
                                                         ("uniform", "rnm-exp", "gem", "mgem", "rs-geometric", "combined-gem")) + " |",
           "|---|---|" + "---|" * 6]
    for sc, curves in r["curves"].items():
        cells = [f"{curves[m][i01]:.3g} / {curves[m][i1]:.3g}" for m in
                 ("uniform", "rnm-exp", "gem", "mgem", "rs-geometric", "combined-gem")]
        out.append(f"| {sc} | {r['scenarios'][sc]['mean_spearman']:+.2f} | " + " | ".join(cells) + " |")
    out += ["", "Orderings the paper reports, checked on these curves:", ""]
    for e, table in r["orderings"].items():
        for name, ok in table.items():
            out.append(f"- {e}: {name}: **{'reproduced' if ok else 'NOT reproduced'}**")
    return out


def rec_section(r) -> list[str]:
    eps = r["epsilons"]
    out = ["### Recommendation (EASE scores; `benchmarks/selection/results/selection_recommendation.json`)", "",
           f"Command: `{r['command']}`. Dense EASE (λ = {r['lam']}) instead of SANSA; ML-100K (ratings ≥ 4) and "
           "Amazon Games (3000 most popular items); top-500 unseen candidates per user; item sensitivity = "
           "5%–95% spread of its predicted score over users (declared public, as in the paper). "
           "The paper used Netflix / MovieLens-20M / Amazon-Books, so numbers are not comparable; the paper's "
           "claim is qualitative: mGEM best.", ""]
    for name, info in r["datasets"].items():
        q = info["spearman_quantiles"]
        out.append(f"**{name}** ({info['users_evaluated']} of {info['users_total']} users, {info['items']} items): "
                   f"per-user Spearman(score, Δ) median {q['50']:+.2f} (5%–95%: {q['5']:+.2f} … {q['95']:+.2f}).")
        out.append("")
        out.append("| mechanism | " + " | ".join(f"ε={e}" for e in eps) + " |")
        out.append("|---|" + "---|" * len(eps))
        for m, ys in r["curves"][name].items():
            out.append(f"| {m} | " + " | ".join(f"{y:.4g}" for y in ys) + " |")
        out.append("")
        out.append("Best private mechanism per ε: " + ", ".join(f"{e}: {m}" for e, m in r["best_private_mechanism"][name].items()))
        out.append("")
    return out


def bandit_section(r) -> list[str]:
    out = ["### Two-arm bandit with distribution shift (`benchmarks/selection/results/selection_bandit.json`)", "",
           f"Command: `{r['command']}`; horizon {r['horizon']}, shift at {r['bandit']['shift_at']}, "
           f"ε = {r['epsilon']} per reward (event level), window {r['window']}. Our design.", "",
           "| learner | mean cumulative reward | mean regret vs best arm |", "|---|---|---|"]
    for l, s in r["summary"].items():
        out.append(f"| {l} | {s['mean_cumulative_reward']:.1f} | {s['mean_regret']:.1f} |")
    return out


def main():
    lines = ["## Private selection with heterogeneous sensitivities (`jdp.selection`)", "",
             "Paper: Antonova et al., *Private Selection with Heterogeneous Sensitivities* (SaTML 2025). Its text "
             "lost its formulas and tables, so there are no numeric targets to sit beside ours; we reproduce the "
             "qualitative orderings it states.", ""]
    for name, fn in (("selection_speed", speed_section), ("selection_synthetic", synthetic_section),
                     ("selection_recommendation", rec_section), ("selection_bandit", bandit_section)):
        r = _load(name)
        if r is not None:
            lines += fn(r) + [""]
        else:
            lines += [f"### {name}: not run", ""]
    lines += ["### Shortfalls and notes", "",
              "- Speed: every mechanism is ≥ 20× diffprivlib's reused Exponential object at k = 100 in the run "
              "above; combined GEM is the slowest (its randomized-response bit needs the sign of Spearman's ρ: two "
              "integer sorts per row, NumPy's in threads, since XLA:CPU's sort is ~20× slower) and RS_γ next (one "
              "uniform and two logs per candidate). The 2-core VM's throughput drifts by up to 2× between runs, so "
              "compare rows within one run.",
              "- The speed table predates the privacy audit (merge c9f35ea): `select` now shifts each row by its max "
              "and samples in float64 so outputs are offset-invariant and exact up to float64 rounding. Old vs new "
              "code timed alternately on the shared 2-core CPU (10⁴ rows) kept new/old throughput 0.47 (EM, k = 100) "
              "to 1.0, kRR 0.48-0.87, GEM family 0.61-1.6 (noisy); the table above has not been re-run since, so "
              "its ratios to diffprivlib overstate the current speed by up to about 2x for EM and kRR. Exact "
              "probabilities of Laplace RNM and RS_γ now resolve every quadrature panel and cost about 0.3-0.45 s "
              "per row at k = 100.",
              "- Synthetic: the 'no correlation → RNM best' finding is not reproduced with our generators (GEM wins, "
              "because low-sensitivity candidates are still favoured when Δ is independent of q).",
              "- Recommendation: RS_γ is best at every ε, mGEM second (the paper reports mGEM best); RS_γ and RNMH "
              "use Monte Carlo estimates, the others exact probabilities.",
              "- Bandit: with ε = 10 per reward, the window learners that choose arms with a DP selection mechanism "
              "do worse than UCB and DP-UCB in our design; the paper's positive result is not reproduced.", ""]
    path = ROOT / "README.md"
    path.parent.mkdir(exist_ok=True)
    path.write_text(with_nav(current_names("\n".join(lines) + "\n")))
    print("wrote", path)


if __name__ == "__main__":
    main()
