"""`jdp meta`: task-level DP meta-learning on generated linear-regression tasks.

    jdp meta --algorithm clustering --setting multi-cluster --q 3 --epsilon 10 --n-tasks 300

Prints a short summary: the transfer risk on fresh tasks beside the local-training reference, the
PrivacyReport (unit = task) and timings; --out writes the full result as JSON (strict JSON: a non-finite
number, e.g. the epsilon of a non-private run, is null).
"""
from __future__ import annotations

import concurrent.futures
import pathlib
import time
import warnings as _warnings

from jdp.cli_support import add_deprecated_flag, add_seed_arguments, no_out_hint, noise_seed, privacy_lines, write_result

DEFAULT_EPSILON = 3.0
ALGORITHMS = ("meta-nsgd", "clustering", "ftmrl", "nonprivate", "local")
SETTINGS = ("single-cluster", "multi-cluster", "authors")


def register(subparsers) -> None:
    p = subparsers.add_parser("meta", help="task-level DP meta-learning (meta-NSGD, clustering, DP-FTMRL)",
                              description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", choices=ALGORITHMS, default="meta-nsgd")
    p.add_argument("--setting", choices=SETTINGS, default="single-cluster")
    p.add_argument("--n-tasks", type=int, default=300, help="training tasks K")
    p.add_argument("--n-points", type=int, default=10, help="examples per training task")
    p.add_argument("--n-test-tasks", type=int, default=400)
    p.add_argument("--n-finetune", type=int, default=10, help="fine-tuning examples per test task (40 more test)")
    p.add_argument("--n-test-points", type=int, default=40, help="held-out examples per test task")
    p.add_argument("--dim", type=int, default=30)
    p.add_argument("--learner", choices=("sgd", "ridge"), default="sgd",
                   help="base learner: fixed-step minibatch SGD (the paper's) or the exact ridge solution")
    p.add_argument("--epsilon", type=float, default=None,
                   help=f"(default: {DEFAULT_EPSILON}); the private algorithms' target, refused with nonprivate / local")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--q", type=int, default=1, help="meta-models (clustering)")
    p.add_argument("--steps", type=int, default=None, help="meta steps T (default K)")
    p.add_argument("--batch-size", type=int, default=10, help="(expected) tasks per step")
    p.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--calibration", choices=("accountant", "theory"), default="accountant")
    p.add_argument("--l2-clip", type=float, default=None, help="meta-gradient L2 clip C (default 4 single, 2 multi)")
    add_deprecated_flag(p, "--clip", "--l2-clip")  # its name before this release
    p.add_argument("--meta-lr", type=float, default=0.35)
    p.add_argument("--lam", type=float, default=0.8, help="base-learner regularisation λ")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--inner-lr", type=float, default=0.07)
    p.add_argument("--inner-batch", type=int, default=4)
    p.add_argument("--output-iterate", choices=("last", "average"), default="last")
    add_seed_arguments(p)
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over the stages (stderr)")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="PNG: transfer risk beside local training")
    p.set_defaults(func=run)


def _generate(setting, key, k, n, d):
    from jdp import meta as M
    if setting == "single-cluster":
        return M.single_cluster_regression(key, k, n, d)[0]
    if setting == "multi-cluster":
        return M.multi_cluster_regression(key, k, n, d)[0]
    return M.authors_regression(key, k, n, d)[0]


def run(args) -> int:
    private, l2_clip, steps = _checked(args)  # every refusal before any work (generating tasks takes seconds)
    from tqdm.auto import tqdm
    stages = tqdm(total=3, desc="jdp meta", unit="stage", disable=args.no_progress)
    stages.set_postfix_str("generating tasks")
    timings = {}
    t0 = time.perf_counter()
    seed = noise_seed(args)
    tasks = _tasks(args)
    timings["generate_s"] = time.perf_counter() - t0
    stages.update()
    stages.set_postfix_str(f"{args.algorithm}: calibration, compilation and {steps} steps")
    t0 = time.perf_counter()
    result = _train(args, tasks, seed, l2_clip, steps)
    timings["train_s"] = time.perf_counter() - t0
    stages.update()
    stages.set_postfix_str("evaluating on test tasks")
    t0 = time.perf_counter()
    risk, local, privacy = _evaluate(args, tasks, result)
    timings["evaluate_s"] = time.perf_counter() - t0
    stages.update()
    stages.close()
    out = {
        "algorithm": args.algorithm, "setting": args.setting, "n_tasks": args.n_tasks, "q": args.q,
        "epsilon_target": None if args.algorithm in ("nonprivate", "local") else args.epsilon,
        "transfer_risk": risk, "local_training_risk": local,
        "noise_multiplier": None if result is None else result.noise_multiplier,
        "steps": None if result is None else result.steps,
        "batch_size": None if result is None else result.batch_size,
        "privacy": privacy, "timings": timings, "seed": seed, "data_seed": args.data_seed,
    }
    if result is not None and args.algorithm != "nonprivate" and risk > local:
        out["warnings"] = [f"the private meta-initialisation (transfer risk {risk:.4g}) is worse than local "
                           f"training ({local:.4g}: each task learns from its own data alone, nothing released)"]
    _write_and_summarise(args, out, result)
    return 0


def _checked(args) -> tuple[bool, float, int]:
    """(private, l2 clip bound, steps) after every check of the flags; ValueError naming the flag otherwise."""
    from jdp.validation import check_positive, check_privacy
    for name in ("n_tasks", "n_points", "n_test_tasks", "n_test_points", "dim", "batch_size", "inner_steps", "inner_batch", "q"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    private = args.algorithm not in ("nonprivate", "local")  # the library's rule, before the tasks are generated
    if not private and args.epsilon is not None:
        raise ValueError(f"--epsilon {args.epsilon:g} would be ignored: --algorithm {args.algorithm} releases "
                         f"{'nothing' if args.algorithm == 'local' else 'without noise (no guarantee)'}; drop --epsilon "
                         "or choose a private --algorithm")
    args.epsilon = DEFAULT_EPSILON if args.epsilon is None else args.epsilon
    with _warnings.catch_warnings():  # refusals here; its warnings come once, from the library's own call
        _warnings.simplefilter("ignore", UserWarning)
        check_privacy(args.epsilon if private else None, args.delta, args.n_tasks if private else None, unit="task",
                      epsilon_name="--epsilon", delta_name="--delta")
    if not 0 < args.n_finetune:
        raise ValueError(f"--n-finetune must be >= 1, got {args.n_finetune}")
    if args.algorithm in ("meta-nsgd", "ftmrl") and args.q != 1:
        raise ValueError(f"--q must be 1 for --algorithm {args.algorithm} (use clustering)")
    l2_clip = args.l2_clip if args.l2_clip is not None else (4.0 if args.setting == "single-cluster" else 2.0)
    check_positive(l2_clip, "--l2-clip")
    return private, l2_clip, args.steps or args.n_tasks


def _tasks(args) -> dict:
    """The generated training tasks, the test tasks' fine-tuning and test points, the learner and the template
    (public randomness from --data-seed), and the evaluation key."""
    import jax
    import jax.numpy as jnp

    from jdp import meta as M
    k_tr, k_te, k_ev = jax.random.split(jax.random.key(args.data_seed), 3)  # tasks + evaluation: public randomness
    train = _generate(args.setting, k_tr, args.n_tasks, args.n_points, args.dim)
    ft, ts = _generate(args.setting, k_te, args.n_test_tasks, args.n_finetune + args.n_test_points, args.dim).split_points(
        args.n_finetune)
    learner = (M.RidgeLearner(lam=args.lam) if args.learner == "ridge" else
               M.SGDLearner(M.squared_loss, lam=args.lam, steps=args.inner_steps, lr=args.inner_lr,
                            batch_size=args.inner_batch))
    return {"train": train, "finetune": ft, "test": ts, "learner": learner, "template": jnp.zeros(args.dim),
            "eval_key": k_ev}


def _train(args, tasks: dict, seed: int, l2_clip: float, steps: int):
    """The chosen algorithm's result (None for local training, which releases nothing)."""
    import jax

    from jdp import meta as M
    k_run = jax.random.key(seed)  # the mechanism's noise
    train, learner, template = tasks["train"], tasks["learner"], tasks["template"]
    common = dict(steps=steps, batch_size=args.batch_size, meta_lr=args.meta_lr)
    private = dict(epsilon=args.epsilon, delta=args.delta, l2_clip=l2_clip, sampling=args.sampling,
                   calibration=args.calibration, output=args.output_iterate)
    result = None
    if args.algorithm == "meta-nsgd":
        result = M.meta_nsgd(k_run, train, learner, template, **common, **private)
    elif args.algorithm == "clustering":
        result = M.private_clustering_meta(k_run, train, learner, args.q, template=template, **common, **private)
    elif args.algorithm == "ftmrl":
        result = M.dp_ftmrl(k_run, train, learner, template, epsilon=args.epsilon, delta=args.delta,
                            meta_lr=args.meta_lr, l2_clip=l2_clip, batch_size=args.batch_size, output=args.output_iterate)
    elif args.algorithm == "nonprivate":
        result = M.meta_sgd_nonprivate(k_run, train, learner, q=args.q, template=template,
                                       sampling=args.sampling, output=args.output_iterate, **common)
    if result is not None:
        jax.block_until_ready(result.flat)
    return result


def _evaluate(args, tasks: dict, result) -> tuple[float, float, dict]:
    """(transfer risk, local-training risk, the report as a dict) on the test tasks."""
    from jdp import meta as M
    k_ev, learner, template, ft, ts = (tasks["eval_key"], tasks["learner"], tasks["template"], tasks["finetune"],
                                       tasks["test"])
    # the report's ε under each relation (dp_accounting, ~1 s for 100 subsampled steps, numpy) is computed beside
    # the evaluation (XLA compiling and running): the two share the cores instead of taking turns
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jdp-report") as pool:
        privacy = pool.submit(result.report.to_dict) if result is not None else None
        local = M.local_training_risk(k_ev, learner, template, ft, ts)
        risk = M.transfer_risk(k_ev, learner, result, ft, ts) if result is not None else local
        privacy = privacy.result() if privacy is not None else None
    if privacy is None:  # local training uses no training task: nothing released
        from jdp.accounting import PrivacyReport
        privacy = PrivacyReport(args.delta, unit="task").to_dict()
    return risk, local, privacy


def _write_and_summarise(args, out: dict, result) -> None:
    """The files first (a closed pipe on stdout cannot lose them), then the summary on stdout."""
    wrote = []
    if args.out is not None:
        wrote.append(write_result(args.out, out))
    if args.plot is not None:
        from jdp.plots import meta_run
        wrote.append(f"wrote {meta_run(out, args.plot)}")
    eps = "" if out["epsilon_target"] is None else f" at target epsilon={args.epsilon:g}"
    risk, local, timings = out["transfer_risk"], out["local_training_risk"], out["timings"]
    summary = [f"{args.algorithm}{eps} on GENERATED tasks ({args.setting}, --data-seed {args.data_seed}): "
               f"K={args.n_tasks} training tasks of {args.n_points} points, d={args.dim}, q={args.q}"
               + ("" if result is None else f", {result.steps} steps")
               + ("" if not out["noise_multiplier"] else f", noise multiplier {out['noise_multiplier']:.4g}"),
               f"transfer risk on {args.n_test_tasks} test tasks: {risk:.4f}; local training (zero-cost: each test task "
               f"alone, nothing released): {local:.4f}",
               f"time: generate {timings['generate_s']:.1f} s, train {timings['train_s']:.1f} s, "
               f"evaluate {timings['evaluate_s']:.1f} s"]
    summary += privacy_lines({"non_private": True} if args.algorithm == "nonprivate" else out["privacy"])
    summary += [f"WARNING: {w}" for w in out.get("warnings", [])] + wrote + no_out_hint(args)
    print("\n".join(summary))
