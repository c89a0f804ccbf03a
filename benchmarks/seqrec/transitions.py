"""Private item-to-item transitions (`jdp.seqrec.transitions`, one Gaussian release) on Amazon Games, beside the
paper's Table 2 and our DP-SGD Transformers (or on ML-100K with `--data ml-100k`).

    PYTHONPATH=. python -m benchmarks.seqrec.transitions [--data amazon-games] [--data-dir DIR] [--epsilons 5 8 10]
        [--ks 250 500 1000 2000] [--seeds 0 1] [--rule-only]

For every ε, seed and K (the number of candidate items, picked from the same run's released popularity): test
and validation NDCG@10 / HIT@10 (full ranking, history not masked, the committed SASRec split), and the K with
the best mean validation NDCG@10 over the seeds (a NON-PRIVATE choice on validation data, as the paper's
learning-rate grid), and the public rule's K (`transitions.default_k`, k=None) for every ε and seed. Plus the
NON-PRIVATE reference (exact counts and sums) at every K, and the popularity ranking
of the exact counts among the same K (NON-PRIVATE, what the candidates alone give). Writes
benchmarks/seqrec/results/seqrec_transitions.json (`seqrec_transitions_<data>.json` for other data;
`--rule-only`: the rule's rows alone, in `seqrec_transitions_rule[_<data>].json`).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from benchmarks.common import write_results
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import transitions as T

DELTA = 1e-5


def scored(model: T.TransitionModel, data: D.SeqData) -> dict:
    v = model.evaluate(data.valid_input, data.valid_target)
    t = model.evaluate(data.test_input, data.test_target)
    return {"ndcg_at_10_valid": v["ndcg"], "hit_at_10_valid": v["hit"], "ndcg_at_10_test": t["ndcg"],
            "hit_at_10_test": t["hit"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="amazon-games", choices=["amazon-games", "ml-100k"])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[5.0, 8.0, 10.0])
    ap.add_argument("--ks", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--history", type=int, default=3)
    ap.add_argument("--rule-only", action="store_true", help="only the rule's K (no grid, no non-private rows)")
    args = ap.parse_args(argv)
    if args.rule_only:
        args.ks = []
    data = D.load(args.data, path=fetch(args.data, args.data_dir))
    rows = []
    for k in args.ks:
        t0 = time.perf_counter()
        ref = T.fit(data, None, DELTA, k, jax.random.key(0), history=args.history)
        m = scored(ref, data)
        rows.append({"epsilon": None, "k": k, "seed": None, **m, "seconds": time.perf_counter() - t0})
        popular = scored(dataclasses.replace(ref, matrix=np.zeros_like(ref.matrix)), data)  # ties: the counts
        rows.append({"epsilon": None, "k": k, "seed": None, "popularity_only": True, **popular})
        print(f"non-private K {k}: valid {100 * m['ndcg_at_10_valid']:.2f} test {100 * m['ndcg_at_10_test']:.2f}",
              flush=True)
    for eps in args.epsilons:
        for seed in args.seeds:
            for k in [*args.ks, None]:  # None: the public rule (default_k)
                t0 = time.perf_counter()
                model = T.fit(data, eps, DELTA, k, jax.random.key(seed), history=args.history)
                m = scored(model, data)
                rows.append({"epsilon": eps, "k": k or int(model.items.size), "rule": k is None, "seed": seed, **m, "noise_multiplier": model.noise_multiplier,
                             "report_epsilon": model.report.epsilon(), "seconds": time.perf_counter() - t0})
                print(f"eps {eps} seed {seed} K {model.items.size}{' (rule)' if k is None else ''}: sigma {model.noise_multiplier:.3f} valid "
                      f"{100 * m['ndcg_at_10_valid']:.2f} test {100 * m['ndcg_at_10_test']:.2f}", flush=True)
    chosen = []
    for eps in ([None] if args.ks else []) + args.epsilons:
        rule = [r for r in rows if r["epsilon"] == eps and r.get("rule")]
        if rule:
            chosen.append({"epsilon": eps, "k_rule": rule[0]["k"], "rule": True,
                           "ndcg_at_10_test_mean": float(np.mean([r["ndcg_at_10_test"] for r in rule])),
                           "ndcg_at_10_valid_mean": float(np.mean([r["ndcg_at_10_valid"] for r in rule])),
                           "hit_at_10_test_mean": float(np.mean([r["hit_at_10_test"] for r in rule])),
                           "n_seeds": len(rule)})
            print(chosen[-1], flush=True)
        if not args.ks:
            continue
        mine = [r for r in rows if r["epsilon"] == eps and not r.get("popularity_only") and not r.get("rule")]
        valid = {k: np.mean([r["ndcg_at_10_valid"] for r in mine if r["k"] == k]) for k in args.ks}
        best = max(args.ks, key=lambda k: valid[k])
        test = [r["ndcg_at_10_test"] for r in mine if r["k"] == best]
        hit = [r["hit_at_10_test"] for r in mine if r["k"] == best]
        chosen.append({"epsilon": eps, "k_chosen_on_validation": best, "ndcg_at_10_test_mean": float(np.mean(test)),
                       "ndcg_at_10_test_std": float(np.std(test)), "hit_at_10_test_mean": float(np.mean(hit)),
                       "n_seeds": len(test)})
        print(chosen[-1], flush=True)
    name = ("seqrec_transitions" + ("_rule" if args.rule_only else "")
            + ("" if args.data == "amazon-games" else f"_{args.data}"))
    path = write_results(name, rows, chosen=chosen, delta=DELTA, history=args.history,
                         hist_noise_multiplier=4.0,
                         note="K chosen on validation NDCG@10 (a NON-PRIVATE choice, as the paper's lr grid); "
                              "the candidates inside every private run come from its own released popularity")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
