"""`jdp select ...`: private selection from the command line.

  jdp select list
  jdp select run --mechanism gem --epsilon 1 --scores S.npy --sensitivities D.npy [--out r.json]
  jdp select run --mechanism mgem --epsilon 0.5 --scenario bimodal-positive --problems 10000 --k 100
  jdp select curves --scenario polarised-strong --k 100 --trials 32 [--epsilons 0.1 1 10]
  jdp select recommend --scores S.npy --sensitivities D.npy      (NON-PRIVATE diagnostic)

Scores are [B, k] (one selection problem per row, e.g. one user's candidate items) or [k]; sensitivities
[k] or [B, k], .npy or comma-separated text. Output JSON holds the selections, timings and, for `run`,
the PrivacyReport under "privacy" (per privacy unit: each row is assumed to read only its own unit's
data, so rows compose in parallel; pass --rows-share-data to compose them sequentially instead).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from jdp.cli import add_seed_arguments, noise_seed, result_json


def _load(path: str, name: str) -> np.ndarray:
    p = pathlib.Path(path)
    if not p.exists():
        raise ValueError(f"{name}: file not found: {path}")
    arr = np.load(p) if p.suffix == ".npy" else np.loadtxt(p, delimiter=",", ndmin=1)
    return np.asarray(arr, np.float64)  # select shifts each row in float64: never round user scores first


def _scenario(name: str):
    from jdp.selection import scenarios as SC
    found = {s.name: s for s in SC.all_scenarios()}
    if name not in found:
        raise ValueError(f"--scenario must be one of {sorted(found)}, got {name!r}")
    return found[name]


def _problem(args):
    if args.scores is not None:
        if args.sensitivities is None:
            raise ValueError("--sensitivities is required with --scores (public per-candidate sensitivities)")
        return _load(args.scores, "--scores"), _load(args.sensitivities, "--sensitivities"), "file"
    sc = _scenario(args.scenario)
    q, d = sc.draw(np.random.default_rng(args.data_seed), args.problems, args.k)
    return q.astype(np.float64), d.astype(np.float64), f"scenario:{sc.name}"


def _plot(command: str, payload: dict, path: str | None) -> None:
    if path:
        from jdp.plots import save_plot
        save_plot(command, payload, path)


def _emit(payload: dict, out: str | None, result: bool = False) -> None:
    """Writes `payload` to `out` (else stdout); `result`: a private run's result, with its privacy scope."""
    text = result_json(payload) if result else json.dumps(payload, indent=2, default=float)
    if out:
        pathlib.Path(out).write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)


def _params(pairs):
    params = {}
    for item in pairs or []:
        if "=" not in item:
            raise ValueError(f"--param expects name=value, got {item!r}")
        key, value = item.split("=", 1)
        try:
            params[key] = float(value) if key not in ("base", "stopping") else value
        except ValueError:
            params[key] = value
        if key in ("frontier_size", "block"):
            params[key] = int(float(value))
    return params


def run(args) -> int:
    import jax

    from jdp import selection as S
    from jdp.validation import check_epsilon
    if args.select_command == "list":
        rows = {n: m.description for n, m in S.PRIVATE_MECHANISMS.items()}
        rows.update({n: m.description for n, m in S.NONPRIVATE_REFERENCES.items()})
        _emit({"private": sorted(S.PRIVATE_MECHANISMS), "nonprivate_references": sorted(S.NONPRIVATE_REFERENCES),
               "descriptions": rows}, args.out)
        return 0
    if args.select_command == "recommend":
        q, d, source = _problem(args)
        rec = S.recommend_mechanism_nonprivate(q.reshape(-1, q.shape[-1])[0] if q.ndim > 1 else q,
                                               d.reshape(-1, d.shape[-1])[0] if d.ndim > 1 else d)
        _emit({"warning": "non-private diagnostic: it reads the scores", "source": source, **rec}, args.out)
        return 0
    if args.select_command == "curves":
        from jdp.selection import scenarios as SC
        for e in args.epsilons:
            check_epsilon(e, "--epsilons")
        for name in ("trials", "k"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
        sc = _scenario(args.scenario)
        q, d = sc.draw(np.random.default_rng(args.data_seed), args.trials, args.k)
        t0 = time.perf_counter()
        curves = SC.mse_curves(q, d, args.mechanisms or SC.DEFAULT_MECHANISMS, args.epsilons,
                               progress=not args.no_progress)
        _emit({"scenario": sc.name, "description": sc.description, "k": args.k, "trials": args.trials,
               "epsilons": args.epsilons, "mse": curves, "timings": {"seconds": time.perf_counter() - t0}},
              args.out)
        _plot("select curves", {"scenario": sc.name, "k": args.k, "trials": args.trials, "epsilons": args.epsilons,
                                "mse": curves}, getattr(args, "plot", None))
        return 0
    # run
    epsilon = check_epsilon(args.epsilon, "--epsilon")
    params = _params(args.param)
    if args.mechanism in S.NONPRIVATE_REFERENCES:
        raise ValueError(f"{args.mechanism!r} is not differentially private (a reference): `jdp select run` "
                         "runs private mechanisms only (`jdp select list`); references run from Python with "
                         "jdp.selection.select(..., allow_nonprivate=True)")
    mech = S.get_mechanism(args.mechanism)  # private registry only
    mech.check_params(params)
    q, d, source = _problem(args)
    seed = noise_seed(args)
    key = jax.random.key(seed)
    t0 = time.perf_counter()
    idx = S.select(args.mechanism, key, q, d, epsilon, **params)
    idx = np.asarray(jax.block_until_ready(idx))
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    jax.block_until_ready(S.select(args.mechanism, jax.random.fold_in(key, 1), q, d, epsilon, **params))
    warm = time.perf_counter() - t1  # timing only; this second draw is discarded, never released
    count = idx.size if args.rows_share_data else 1
    report = S.privacy_report(args.mechanism, epsilon, count=count, **params)
    n = idx.size
    payload = {"mechanism": args.mechanism, "epsilon": epsilon, "params": params, "source": source, "seed": seed,
               "problems": int(n), "k": int(q.shape[-1]), "selections": idx.reshape(-1).tolist()[: args.max_print],
               "privacy": report.to_dict(),
               "timings": {"first_call_s": first, "warm_call_s": warm, "selections_per_second": n / warm}}
    if q.ndim == 2:
        best = q.max(-1)
        chosen = np.take_along_axis(q, idx.reshape(-1, 1), axis=-1)[:, 0]
        payload["mse_vs_best"] = float(np.mean((best - chosen) ** 2))  # evaluation, not a release
        # the zero-cost selector: a uniformly random candidate (reads no data, releases nothing), in expectation
        payload["mse_vs_best_uniform"] = float(np.mean((best[:, None] - q) ** 2))
        sq = (best - chosen) ** 2
        if payload["mse_vs_best"] - 2 * float(np.std(sq)) / np.sqrt(sq.size) > payload["mse_vs_best_uniform"]:
            warning = (f"the private selection (MSE vs best {payload['mse_vs_best']:.4g}) is worse than a uniformly "
                       f"random choice ({payload['mse_vs_best_uniform']:.4g}: reads no data, costs no privacy)")
            payload["warnings"] = [warning]
            print(f"WARNING: {warning}", file=sys.stderr)
    print(str(report), file=sys.stderr)
    _emit(payload, args.out, result=True)
    _plot("select run", payload, getattr(args, "plot", None))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("select", help="private selection with heterogeneous sensitivities",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="select_command", required=True)

    def common(sp, data=True):
        sp.add_argument("--out", default=None, help="write JSON here (default: stdout)")
        if data:  # `run` draws noise (--seed); every command with data draws synthetic problems (--data-seed)
            add_seed_arguments(sp)
        else:
            sp.add_argument("--data-seed", type=int, default=0, help="seed of synthetic problems")
        if data:
            sp.add_argument("--scores", default=None, help=".npy or CSV, [B, k] or [k]")
            sp.add_argument("--sensitivities", default=None, help=".npy or CSV, [k] or [B, k] (public)")
            sp.add_argument("--scenario", default="bimodal-positive", help="synthetic problems when no --scores")
            sp.add_argument("--problems", type=int, default=1000)
            sp.add_argument("--k", type=int, default=100)

    common(sub.add_parser("list", help="list mechanisms"), data=False)
    r = sub.add_parser("run", help="run a private mechanism on every row")
    r.add_argument("--mechanism", default="rnm-exp", help="a private mechanism (see `jdp select list`)")
    r.add_argument("--epsilon", type=float, required=True)
    r.add_argument("--param", action="append", help="mechanism parameter name=value (repeatable)")
    r.add_argument("--rows-share-data", action="store_true",
                   help="rows read the same units' data: compose B selections sequentially")
    r.add_argument("--max-print", type=int, default=1000)
    common(r)
    r.add_argument("--plot", default=None, help="PNG: how often each candidate was selected")
    c = sub.add_parser("curves", help="noise-free MSE vs ε curves on a synthetic scenario")
    c.add_argument("--scenario", default="bimodal-positive")
    c.add_argument("--k", type=int, default=100)
    c.add_argument("--trials", type=int, default=16)
    c.add_argument("--no-progress", action="store_true", help="no progress bar (it is written to stderr)")
    c.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    c.add_argument("--mechanisms", nargs="+", default=None)
    common(c, data=False)
    c.add_argument("--plot", default=None, help="PNG: expected squared error against ε per mechanism")
    common(sub.add_parser("recommend", help="NON-PRIVATE: suggest a mechanism from score/sensitivity correlation"))
    p.set_defaults(func=run)
