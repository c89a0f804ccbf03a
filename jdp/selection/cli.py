"""`jdp select ...`: private selection from the command line.

  jdp select list
  jdp select run --mechanism gem --epsilon 1 --scores S.npy --sensitivities D.npy [--out r.json]
  jdp select run --mechanism mgem --epsilon 0.5 --scenario bimodal-positive --problems 10000 --k 100
  jdp select curves --scenario polarised-strong --k 100 --trials 32 [--epsilons 0.1 1 10]
  jdp select recommend --scores S.npy --sensitivities D.npy      (NON-PRIVATE diagnostic)

Scores are [B, k] (one selection problem per row, e.g. one user's candidate items) or [k]; sensitivities
[k] or [B, k], .npy or comma-separated text. Without --scores the problems are GENERATED (--scenario,
--problems, --k, --data-seed) and the summary says so. Every command prints a short summary; --out writes
the full result as JSON (strict JSON: a non-finite number is null). For `run` that is every selection,
the timings and the PrivacyReport under "privacy" (per privacy unit: each row is assumed to read only its
own unit's data, so rows compose in parallel; pass --rows-share-data to compose them sequentially instead).
"""
from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np

from jdp.cli_support import add_seed_arguments, no_out_hint, noise_seed, privacy_lines, to_json, write_result

# the generated problems' options; None on the command line = not given (refused beside --scores)
SCENARIO_DEFAULTS = {"scenario": "bimodal-positive", "problems": 1000, "k": 100}


def _load(path: str, name: str) -> np.ndarray:
    """The array in `path` (.npy, else comma-separated numbers without a header), refused with the flag `name`
    when it is missing, a folder, empty or not numbers."""
    import warnings
    p = pathlib.Path(path)
    if not p.exists():
        raise ValueError(f"{name}: file not found: {path}")
    if p.is_dir():
        raise ValueError(f"{name}: {path} is a directory; give a .npy file or a comma-separated text file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # numpy's "input contained no data": refused below
            arr = np.load(p) if p.suffix == ".npy" else np.loadtxt(p, delimiter=",", ndmin=1)
        arr = np.asarray(arr, np.float64)  # select shifts each row in float64: never round user scores first
    except (ValueError, TypeError, OSError, EOFError) as err:
        raise ValueError(f"{name}: {path} is not a .npy array or comma-separated numbers (a header line, a "
                         f"non-numeric field?): {err}") from None
    if arr.size == 0:
        raise ValueError(f"{name}: {path} holds no numbers")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: {path} holds NaN or inf values ({int(np.sum(~np.isfinite(arr)))} of {arr.size})")
    return arr


def _scenario(name: str):
    from jdp.selection import scenarios as SC
    found = {s.name: s for s in SC.all_scenarios()}
    if name not in found:
        raise ValueError(f"--scenario must be one of {sorted(found)}, got {name!r}")
    return found[name]


def _problem(args):
    """(scores, sensitivities, source, description): the user's files, else generated problems. A scenario
    option beside --scores, or --sensitivities without --scores, is refused: it would be ignored."""
    if args.scores is not None:
        if args.sensitivities is None:
            raise ValueError("--sensitivities is required with --scores (public per-candidate sensitivities)")
        given = [f"--{n}" for n in SCENARIO_DEFAULTS if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} describe generated problems and would be ignored beside --scores: "
                             "leave them out (the problems are the rows of --scores)")
        q, d = _load(args.scores, "--scores"), _load(args.sensitivities, "--sensitivities")
        from jdp.validation import check_scores
        check_scores(q, d, "--scores", "--sensitivities")  # shapes agree, sensitivities > 0: before any work
        return q, d, "file", f"problems: scores from {args.scores}, sensitivities from {args.sensitivities}"
    if args.sensitivities is not None:
        raise ValueError("--sensitivities without --scores would be ignored (the problems would be generated): "
                         "give --scores too, or leave out --sensitivities")
    for name, default in SCENARIO_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("problems", "k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    sc = _scenario(args.scenario)
    q, d = sc.draw(np.random.default_rng(args.data_seed), args.problems, args.k)
    return (q.astype(np.float64), d.astype(np.float64), f"scenario:{sc.name}",
            f"problems: GENERATED, {args.problems:,} x {args.k} candidates from scenario '{sc.name}' "
            f"(--data-seed {args.data_seed}); give --scores and --sensitivities to select on your own data")


def _finish(args, payload: dict, summary: list[str], plot: tuple[str, dict] | None = None,
            result: bool = False) -> None:
    """Writes --out (the JSON; `result`: a private run's, with its privacy scope) and --plot first, so that
    a closed pipe cannot lose them, then prints the human summary."""
    wrote = []
    if args.out:
        if result:
            wrote.append(write_result(args.out, payload))
        else:
            pathlib.Path(args.out).write_text(to_json(payload) + "\n")
            wrote.append(f"wrote {args.out} (the full result as JSON)")
    if plot is not None and getattr(args, "plot", None):
        from jdp.plots import save_plot
        wrote.append(f"wrote {save_plot(plot[0], plot[1], args.plot)}")
    print("\n".join(summary + wrote + no_out_hint(args)))


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


def _list(args, S) -> int:
    rows = {n: m.description for n, m in S.PRIVATE_MECHANISMS.items()}
    rows.update({n: m.description for n, m in S.NONPRIVATE_REFERENCES.items()})
    payload = {"private": sorted(S.PRIVATE_MECHANISMS), "nonprivate_references": sorted(S.NONPRIVATE_REFERENCES),
               "descriptions": rows}
    width = max(map(len, rows))
    summary = ["private mechanisms (jdp select run --mechanism NAME):"]
    summary += [f"  {n:<{width}}  {rows[n]}" for n in payload["private"]]
    summary += ["NON-PRIVATE references (Python only, select(..., allow_nonprivate=True)):"]
    summary += [f"  {n:<{width}}  {rows[n]}" for n in payload["nonprivate_references"]]
    _finish(args, payload, summary)
    return 0


def _recommend(args, S) -> int:
    q, d, source, described = _problem(args)
    rec = S.recommend_mechanism_nonprivate(q.reshape(-1, q.shape[-1])[0] if q.ndim > 1 else q,
                                           d.reshape(-1, d.shape[-1])[0] if d.ndim > 1 else d)
    payload = {"warning": "non-private diagnostic: it reads the scores", "source": source, **rec}
    summary = [described, "NON-PRIVATE diagnostic (it reads the scores of the first problem; nothing released):",
               f"  suggested mechanism: {rec['mechanism']}",
               "  score/sensitivity correlation: " + ", ".join(
                   f"{k} {rec[k]:.3f}" for k in ("spearman", "pearson", "weighted") if rec.get(k) is not None)]
    _finish(args, payload, summary)
    return 0


def _curves(args) -> int:
    from jdp.selection import scenarios as SC
    from jdp.validation import check_epsilon
    for e in args.epsilons:
        check_epsilon(e, "--epsilons")
        _below_max_epsilon(e, "--epsilons")
    for name in ("trials", "k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    sc = _scenario(args.scenario)
    q, d = sc.draw(np.random.default_rng(args.data_seed), args.trials, args.k)
    t0 = time.perf_counter()
    curves = SC.mse_curves(q, d, args.mechanisms or SC.DEFAULT_MECHANISMS, args.epsilons,
                           progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    payload = {"scenario": sc.name, "description": sc.description, "k": args.k, "trials": args.trials,
               "epsilons": args.epsilons, "mse": curves, "timings": {"seconds": seconds}}
    width = max(map(len, curves))
    summary = [f"expected squared error of the selected score (exact probabilities, no noise drawn) on "
               f"{args.trials} GENERATED problems x {args.k} candidates, scenario '{sc.name}' "
               f"(--data-seed {args.data_seed}), {seconds:.1f} s",
               f"  {'mechanism':<{width}}" + "".join(f"{'eps=' + format(e, 'g'):>12}" for e in args.epsilons)]
    summary += [f"  {name:<{width}}" + "".join(f"{v:>12.4g}" for v in curve) for name, curve in curves.items()]
    _finish(args, payload, summary, plot=("select curves", payload))
    return 0


def _below_max_epsilon(epsilon: float, flag: str) -> float:
    """The one rule's bound (`jdp.validation.MAX_EPSILON`), refused before any work with the flag's name."""
    from jdp.validation import MAX_EPSILON
    if epsilon > MAX_EPSILON:
        raise ValueError(f"{flag} {epsilon:g} is above the largest epsilon jdp accepts, {MAX_EPSILON:g}: at such an "
                         "epsilon a selection protects nothing; give a meaningful epsilon (at most 30 or so)")
    return epsilon


def _check_sequential_total(S, mechanism: str, epsilon: float, rows: int, params: dict) -> None:
    """--rows-share-data composes one selection per row. Refused before any work when the total is surely above
    `MAX_EPSILON`: each selection's event is a randomized response at its ε1 (the report of one), and the composed
    ε of `rows` of them is at least about their mean privacy loss, rows · ε1 · tanh(ε1 / 2) (such a total would also
    take the accountant minutes: 10,000 selections at ε = 1 did not finish in 200 s)."""
    import math

    from jdp.validation import MAX_EPSILON
    one = S.privacy_report(mechanism, epsilon, count=1, **params).to_dict().get("epsilon") or 0.0
    least = rows * one * math.tanh(one / 2)
    if least > MAX_EPSILON:
        raise ValueError(f"--rows-share-data composes {rows:,} selections at epsilon {one:.4g} each: the total would "
                         f"be above {least:,.0f}, beyond the largest epsilon jdp accepts ({MAX_EPSILON:g}), a guarantee "
                         "that protects nothing. Give fewer rows or a smaller --epsilon, or leave out --rows-share-data "
                         "if each row reads only its own users' data")


def run(args) -> int:
    from jdp import selection as S
    if args.select_command == "list":
        return _list(args, S)
    if args.select_command == "recommend":
        return _recommend(args, S)
    if args.select_command == "curves":
        return _curves(args)
    return _run(args, S)


def _run(args, S) -> int:
    import jax

    from jdp.validation import check_epsilon
    epsilon = _below_max_epsilon(check_epsilon(args.epsilon, "--epsilon"), "--epsilon")
    if args.max_print < 0:
        raise ValueError(f"--max-print must be >= 0, got {args.max_print}")
    params = _params(args.param)
    if args.mechanism in S.NONPRIVATE_REFERENCES:
        raise ValueError(f"{args.mechanism!r} is not differentially private (a reference): `jdp select run` "
                         "runs private mechanisms only (`jdp select list`); references run from Python with "
                         "jdp.selection.select(..., allow_nonprivate=True)")
    mech = S.get_mechanism(args.mechanism)  # private registry only
    mech.check_params(params)
    q, d, source, described = _problem(args)
    if args.rows_share_data:
        _check_sequential_total(S, args.mechanism, epsilon, int(np.prod(q.shape[:-1])), params)
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
    selections = idx.reshape(-1).tolist()
    payload = {"mechanism": args.mechanism, "epsilon": epsilon, "params": params, "source": source, "seed": seed,
               "problems": int(n), "k": int(q.shape[-1]), "selections": selections,  # all of them
               "privacy": report.to_dict(),
               "timings": {"first_call_s": first, "warm_call_s": warm, "selections_per_second": n / warm}}
    warnings = []
    if q.ndim == 2:
        best = q.max(-1)
        chosen = np.take_along_axis(q, idx.reshape(-1, 1), axis=-1)[:, 0]
        payload["mse_vs_best"] = float(np.mean((best - chosen) ** 2))  # evaluation, not a release
        # the zero-cost selector: a uniformly random candidate (reads no data, releases nothing), in expectation
        payload["mse_vs_best_uniform"] = float(np.mean((best[:, None] - q) ** 2))
        sq = (best - chosen) ** 2
        if payload["mse_vs_best"] - 2 * float(np.std(sq)) / np.sqrt(sq.size) > payload["mse_vs_best_uniform"]:
            warnings.append(f"the private selection (MSE vs best {payload['mse_vs_best']:.4g}) is worse than a "
                            f"uniformly random choice ({payload['mse_vs_best_uniform']:.4g}: reads no data, costs "
                            "no privacy)")
            payload["warnings"] = warnings
    shown = selections[: args.max_print]
    summary = [described,
               f"{args.mechanism} at epsilon={epsilon:g}: {n:,} selections in {warm:.3g} s "
               f"({n / warm:,.0f} per second after a first call of {first:.3g} s)"]
    if shown:
        more = f" ... ({n - len(shown):,} more{' in --out' if args.out else '; --out writes all'})" \
            if len(shown) < n else ""
        summary.append(f"selected: {' '.join(map(str, shown))}{more}")
    if "mse_vs_best" in payload:
        summary.append(f"squared error vs the best candidate (evaluation on the scores, not a release): "
                       f"{payload['mse_vs_best']:.4g}; a uniformly random choice (zero-cost): "
                       f"{payload['mse_vs_best_uniform']:.4g}")
    summary += privacy_lines(payload["privacy"]) + [f"WARNING: {w}" for w in warnings]
    _finish(args, payload, summary, plot=("select run", payload), result=True)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("select", help="private selection with heterogeneous sensitivities",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="select_command", required=True)

    def common(sp, data=True, noise=True, problems=True):
        sp.add_argument("--out", default=None, help="write the full result as JSON here (the summary is printed)")
        # only what a command uses: `run` draws noise (--seed); commands that generate problems take --data-seed
        # (`list` neither, `recommend` draws no noise): an option that would be ignored is not offered
        if data and noise:
            add_seed_arguments(sp)
        elif problems:
            sp.add_argument("--data-seed", type=int, default=0,
                            help="seed of synthetic data generation (not of any noise)")
        if data:
            sp.add_argument("--scores", default=None, help=".npy or CSV, [B, k] or [k]")
            sp.add_argument("--sensitivities", default=None, help=".npy or CSV, [k] or [B, k] (public); with --scores")
            sp.add_argument("--scenario", default=None,
                            help="generated problems when no --scores (default: bimodal-positive)")
            sp.add_argument("--problems", type=int, default=None,
                            help="generated problems B when no --scores (default: 1000)")
            sp.add_argument("--k", type=int, default=None, help="candidates per generated problem (default: 100)")

    common(sub.add_parser("list", help="list mechanisms"), data=False, problems=False)
    r = sub.add_parser("run", help="run a private mechanism on every row")
    r.add_argument("--mechanism", default="rnm-exp", help="a private mechanism (see `jdp select list`)")
    r.add_argument("--epsilon", type=float, required=True, help="epsilon of each selection")
    r.add_argument("--param", action="append", help="mechanism parameter name=value (repeatable)")
    r.add_argument("--rows-share-data", action="store_true",
                   help="rows read the same units' data: compose B selections sequentially")
    r.add_argument("--max-print", type=int, default=20,
                   help="selections shown in the summary (--out always holds all of them)")
    common(r)
    r.add_argument("--plot", default=None, help="PNG: how often each candidate was selected (all rows)")
    c = sub.add_parser("curves", help="noise-free MSE vs ε curves on a synthetic scenario")
    c.add_argument("--scenario", default="bimodal-positive", help="the generated problems")
    c.add_argument("--k", type=int, default=100, help="candidates per problem")
    c.add_argument("--trials", type=int, default=16, help="generated problems")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (it is written to stderr)")
    c.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    c.add_argument("--mechanisms", nargs="+", default=None, help="(default: scenarios.DEFAULT_MECHANISMS)")
    common(c, data=False)
    c.add_argument("--plot", default=None, help="PNG: expected squared error against ε per mechanism")
    common(sub.add_parser("recommend", help="NON-PRIVATE: suggest a mechanism from score/sensitivity correlation"),
           noise=False)
    p.set_defaults(func=run)


__all__ = ["register", "run"]
