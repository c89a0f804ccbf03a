"""Task-level DP meta-learning experiments (Zhou & Bassily 2022, Sec. 6) and the speed benchmark.

Transfer risk vs number of training tasks N (100..700) on synthetic linear regression (d = 30):
single cluster (ε ∈ {1, 3, 10, ∞}, q = 1), multi-cluster (ε ∈ {1, 3, 10, ∞}, q ∈ {1, 2, 3}) and the
authors' generator variant (features uniform in [0,1]^30, rows normalised), local training and
DP-FTMRL, 5 repetitions. Privacy unit: one task; meta-NSGD / clustering use Poisson task sampling
(expected 10 tasks per step, T = N steps, as the authors' TF-Privacy calibration assumes) accounted with
PoissonSampledDpEvent under add/remove-one-task; one fixed-size (without replacement, replace-one) row
is added for comparison. Every private row also records ε under add/remove one task and under replace
one task (`relation_epsilons`, by dp_accounting from the row's noise multiplier), so rows accounted
natively under different relations (Poisson: add/remove; fixed-size: replace-one; DP-FTMRL: replace by
a null task) compare in one column; `--add-relations` adds them to a stored results file without
re-running the grid.

Hyper-parameters are the authors' code defaults, translated to jdp's convention (regulariser (λ/2)‖w−h‖²,
meta-gradient λ(h − w)): the code's 0.4‖w−h‖² is λ = 0.8, its meta-gradient 0.4(h − w) with step 0.7 and
clip c is jdp's λ(h − w) with step 0.35 and clip 2c. Inner solver: 20 SGD steps, lr 0.07, batch 4.

The whole grid for one (setting, q) is one jit-compiled, vmapped call over repetitions × N × ε.
Speed: the same algorithm as a plain per-task Python/NumPy loop, timed on identical configurations.

    PYTHONPATH=. python -m benchmarks.meta.experiments            # full grid (minutes on 2 CPU cores)
    PYTHONPATH=. python -m benchmarks.meta.experiments --quick    # 2 reps, N in {100, 400}
    PYTHONPATH=. python -m benchmarks.meta.experiments --add-relations   # restate stored rows' ε
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.common import results_dir, write_results
from jdp import accounting as acc
from jdp import meta as M
from jdp.meta import engine, privacy
from jdp.meta.evaluate import per_task_risk

RESULTS_DIR = results_dir(__file__)

D, N_POINTS, N_TEST_POINTS, N_FINETUNE, N_TEST_TASKS, K_POOL = 30, 10, 50, 10, 400, 1000
LAM, INNER_STEPS, INNER_LR, INNER_BATCH, META_LR, BATCH, INIT = 0.8, 20, 0.07, 4, 0.35, 10, 1 / math.sqrt(30)
DELTA = 1e-5
CMD = "PYTHONPATH=. python -m benchmarks.meta.experiments"
LEARNER = M.SGDLearner(M.squared_loss, lam=LAM, steps=INNER_STEPS, lr=INNER_LR, batch_size=INNER_BATCH)
SPEC = engine.FlatSpec.of(jnp.zeros(D))
SETTINGS = {  # name -> (generator, code clip c -> jdp clip 2c)
    "single-cluster": ("ball", 4.0),
    "multi-cluster": ("ball", 2.0),
    "multi-cluster-authors-generator": ("authors", 2.0),
}
PAPER_AUTHORS_Q2 = {3.0: {100: 2.639, 400: 2.289, 700: 2.201}, 10.0: {100: 2.358, 400: 2.178, 700: 2.022},
                    None: {100: 2.274, 400: 1.942, 700: 1.865}}


def generate(setting: str, key, n_tasks: int, n_points: int) -> M.TaskSet:
    if setting == "single-cluster":
        return M.single_cluster_regression(key, n_tasks, n_points, D, 4.0, 1.0, 0.5, "ball")[0]
    if setting == "multi-cluster":
        return M.multi_cluster_regression(key, n_tasks, n_points, D, 0.5, 0.5, "ball")[0]
    return M.authors_regression(key, n_tasks, n_points, D)[0]


@functools.lru_cache(maxsize=None)
def noise_multiplier(n: int, eps: float | None, sampling: str = "poisson") -> float:
    if eps is None:
        return 0.0
    return privacy.calibrate_meta_sgd(eps, DELTA, n, BATCH, n, sampling)


def relation_epsilons(row: dict) -> dict:
    """{"epsilon_add_remove", "epsilon_replace_one"} of a private row from its noise multiplier (std /
    native sensitivity), by `jdp.meta.privacy.epsilon_under` (clip cancels: std is stated in units of C)."""
    if row.get("epsilon") is None or not row.get("noise_multiplier"):
        return {}
    n = int(row["n_tasks"])
    if row["sampling"] == "one pass":
        mech, std, counts = "tree", row["noise_multiplier"], dict(n_tasks=n, batch_size=BATCH, steps=-(-n // BATCH))
    else:
        mech = row["sampling"]
        std = row["noise_multiplier"] * privacy.sensitivity_factor(privacy.native_relation(mech))
        counts = dict(n_tasks=n, batch_size=BATCH, steps=n)
    return {f"epsilon_{name}": privacy.epsilon_under(mech, rel, float(std), 1.0, row["delta"], **counts)
            for name, rel in (("add_remove", acc.ADD_OR_REMOVE_ONE), ("replace_one", acc.REPLACE_ONE))}


def add_relations(path) -> None:
    """Adds relation_epsilons to every private row of a stored results file (no re-run)."""
    d = json.loads(path.read_text())
    for r in tqdm(d["results"], desc="rows"):
        r.update(relation_epsilons(r))
    d["relation_epsilons_added_by"] = CMD + " --add-relations"
    path.write_text(json.dumps(d, indent=2) + "\n")


def grid_runner(q: int, sampling: str, learner=LEARNER):
    """jit(vmap over reps(vmap over configs)) of the engine + evaluation -> risks [R, C]."""
    def one(key, data, mask, n_active, noise_std, clip, h0, ft, ts):
        last, _ = engine.train(key, data, mask, h0, learner=learner, spec=SPEC, batch_size=BATCH, sampling=sampling,
                               steps=n_active, n_active=n_active, meta_lr=META_LR, l2_clip=clip, noise_std=noise_std,
                               radius=jnp.float32(jnp.inf), chunk=20 if sampling == "poisson" else None)
        return jnp.mean(per_task_risk(jax.random.fold_in(key, 7), learner, SPEC, last, ft, ts))

    inner = jax.vmap(one, in_axes=(0, None, None, 0, 0, 0, None, None, None))
    return jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, None, None, 0, 0, 0)))


def run_grid(setting: str, qs, epsilons, ns, reps: int, seed: int = 0, sampling: str = "poisson",
             ftmrl: bool = False, local: bool = True) -> list[dict]:
    gen, clip = SETTINGS[setting]
    root = jax.random.PRNGKey(seed)
    rk = jax.random.split(root, reps)
    pools = [generate(setting, jax.random.fold_in(k, 1), K_POOL, N_POINTS) for k in rk]
    tests = [generate(setting, jax.random.fold_in(k, 2), N_TEST_TASKS, N_TEST_POINTS).split_points(N_FINETUNE)
             for k in rk]
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    data, mask = stack([p.data for p in pools]), stack([p.mask for p in pools])
    ft, ts = stack([t[0] for t in tests]), stack([t[1] for t in tests])
    configs = [(n, e) for n in ns for e in epsilons]
    z = {c: noise_multiplier(c[0], c[1], sampling) for c in configs}
    sens = privacy.sensitivity_factor(privacy.native_relation(sampling)) * clip
    rows = []
    for q in qs:
        h0 = jnp.stack([jnp.stack(jax.tree.leaves(M.random_init(jax.random.fold_in(k, 3), jnp.zeros(D), q, INIT)))
                        for k in rk])
        keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 4 + q), len(configs)))(rk)
        t0 = time.perf_counter()
        risks = grid_runner(q, sampling)(
            keys, data, mask, jnp.array([c[0] for c in configs]),
            jnp.array([z[c] * sens for c in configs], jnp.float32),
            jnp.array([clip if c[1] is not None else jnp.inf for c in configs], jnp.float32), h0, ft, ts)
        risks = np.asarray(jax.block_until_ready(risks))
        wall = time.perf_counter() - t0
        for j, (n, e) in enumerate(configs):
            method = ("meta-NSGD" if q == 1 else "private clustering") if e is not None else (
                "non-private meta-SGD" if q == 1 else "non-private clustering")
            rows.append(dict(setting=setting.replace("-authors-generator", ""), generator=gen, method=method,
                             sampling=sampling, epsilon=e, delta=DELTA if e is not None else None, q=q, n_tasks=n,
                             transfer_risk=float(risks[:, j].mean()), transfer_risk_std=float(risks[:, j].std()),
                             noise_multiplier=z[(n, e)] or None, clip=clip, reps=reps, grid_wall_s=wall))
            rows[-1].update(relation_epsilons(rows[-1]))
    # local training: each new task fits alone from h = 0 (λ = 0.8, and a nearly unregularised λ = 1e-6)
    for lam, name in ((LAM, "local training"), (1e-6, "local training (lambda=1e-6)")) if local else ():
        learner = M.SGDLearner(M.squared_loss, lam=lam, steps=INNER_STEPS, lr=INNER_LR, batch_size=INNER_BATCH)
        loc = np.array([M.local_training_risk(jax.random.fold_in(k, 5), learner, jnp.zeros(D), f, t)
                        for k, (f, t) in zip(rk, tests)])
        for n in ns:
            rows.append(dict(setting=setting.replace("-authors-generator", ""), generator=gen, method=name,
                             sampling=None, epsilon=None, delta=None, q=None, n_tasks=n,
                             transfer_risk=float(loc.mean()), transfer_risk_std=float(loc.std()), reps=reps))
    if ftmrl:
        rows += run_ftmrl(setting, [e for e in epsilons if e is not None], [n for n in ns if n in (100, 400, 700)],
                          pools, tests, rk, clip)
    return rows


def run_ftmrl(setting, epsilons, ns, pools, tests, rk, clip) -> list[dict]:
    """DP-FTMRL: one pass over the N tasks, 10 per step, FTRL step η/B with η = META_LR (fixed a priori)."""
    rows = []
    for n in ns:
        for e in epsilons:
            risks = []
            for k, pool, (f, t) in zip(rk, pools, tests):
                r = M.dp_ftmrl(jax.random.fold_in(k, 6), pool.take(jnp.arange(n)), LEARNER, jnp.zeros(D),
                               epsilon=e, delta=DELTA, meta_lr=META_LR, l2_clip=clip, batch_size=BATCH, output="last")
                risks.append(M.transfer_risk(jax.random.fold_in(k, 7), LEARNER, r, f, t))
            rows.append(dict(setting=setting.replace("-authors-generator", ""), generator=SETTINGS[setting][0],
                             method="DP-FTMRL", sampling="one pass", epsilon=e, delta=DELTA, q=1, n_tasks=n,
                             transfer_risk=float(np.mean(risks)), transfer_risk_std=float(np.std(risks)),
                             noise_multiplier=r.noise_multiplier, clip=clip, reps=len(rk)))
            rows[-1].update(relation_epsilons(rows[-1]))
    return rows


# ----------------------------------------------------------------------------------------------------
# Plain per-task loop implementation (NumPy), the speed baseline: same algorithm, one task at a time.
def loop_inner(x, y, h, rng, minibatch="resample"):
    w = h.copy()
    perm = rng.permutation(len(y)) if minibatch == "cycle" else None
    for s in range(INNER_STEPS):
        if perm is None:
            idx = rng.choice(len(y), INNER_BATCH, replace=False)
        else:
            idx = perm[(s * INNER_BATCH + np.arange(INNER_BATCH)) % len(y)]
        xb, yb = x[idx], y[idx]
        grad = 2.0 / INNER_BATCH * xb.T @ (xb @ w - yb) + LAM * (w - h)
        w -= INNER_LR * grad
    obj = np.mean((x @ w - y) ** 2) + 0.5 * LAM * np.sum((w - h) ** 2)
    return w, obj


def loop_run(x, y, n, q, clip, noise_std, h0, xf, yf, xt, yt, seed, minibatch="resample"):
    rng = np.random.default_rng(seed)
    h = h0.copy()
    for _ in range(n):  # T = N steps, Poisson sampling with rate 10/N
        s = np.zeros_like(h)
        for k in np.flatnonzero(rng.random(n) < BATCH / n):
            fits = [loop_inner(x[k], y[k], h[i], rng, minibatch) for i in range(q)]
            a = int(np.argmin([f[1] for f in fits]))
            g = LAM * (h[a] - fits[a][0])
            s[a] += g * min(1.0, clip / max(np.linalg.norm(g), 1e-12))
        h -= META_LR * (s + noise_std * rng.standard_normal(h.shape)) / BATCH
    risks = []
    for k in range(len(yf)):
        fits = [loop_inner(xf[k], yf[k], h[i], rng, minibatch) for i in range(q)]
        w = fits[int(np.argmin([f[1] for f in fits]))][0]
        risks.append(np.mean((xt[k] @ w - yt[k]) ** 2))
    return float(np.mean(risks))


def speed_benchmark(n: int, q: int, epsilons, reps: int, minibatch: str = "resample") -> dict:
    """The same experiment (authors' generator, q meta-models, N tasks, every ε, `reps` repetitions) run
    vectorised (one compiled call over repetitions × ε) and as the per-task NumPy loop, side by side."""
    setting = "multi-cluster-authors-generator"
    clip = SETTINGS[setting][1]
    rk = jax.random.split(jax.random.PRNGKey(123), reps)
    zs = [noise_multiplier(n, e) for e in epsilons]
    clips = [clip if e is not None else math.inf for e in epsilons]
    pools = [generate(setting, jax.random.fold_in(k, 1), n, N_POINTS) for k in rk]
    tests = [generate(setting, jax.random.fold_in(k, 2), N_TEST_TASKS, N_TEST_POINTS).split_points(N_FINETUNE)
             for k in rk]
    h0s = [np.asarray(jnp.stack(M.random_init(jax.random.fold_in(k, 3), jnp.zeros(D), q, INIT))) for k in rk]
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    args = (jax.vmap(lambda k: jax.random.split(k, len(epsilons)))(rk), stack([p.data for p in pools]),
            stack([p.mask for p in pools]), jnp.array([n] * len(epsilons)),
            jnp.array([z * clip for z in zs], jnp.float32), jnp.array(clips, jnp.float32), jnp.stack(h0s),
            stack([t[0] for t in tests]), stack([t[1] for t in tests]))
    learner = LEARNER if minibatch == "resample" else M.SGDLearner(
        M.squared_loss, lam=LAM, steps=INNER_STEPS, lr=INNER_LR, batch_size=INNER_BATCH, minibatch=minibatch)
    runner = grid_runner(q, "poisson", learner)
    t0 = time.perf_counter()
    compiled = runner.lower(*args).compile()
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    vec = np.asarray(jax.block_until_ready(compiled(*args)))
    t_vec = time.perf_counter() - t0
    t0 = time.perf_counter()
    loop = np.zeros((reps, len(epsilons)))
    for r, (p, (f, t)) in enumerate(zip(pools, tests)):
        (x, y), (xf, yf), (xt, yt) = [jax.tree.map(np.asarray, a.data) for a in (p, f, t)]
        for j, (z, c) in enumerate(zip(zs, clips)):
            loop[r, j] = loop_run(x, y, n, q, c, z * clip, h0s[r], xf, yf, xt, yt, seed=r * 100 + j,
                                  minibatch=minibatch)
    t_loop = time.perf_counter() - t0
    return dict(setting="multi-cluster", generator="authors", method="private clustering + non-private",
                inner_minibatch=minibatch,
                epsilons=list(epsilons), q=q, n_tasks=n, reps=reps, runs=reps * len(epsilons), loop_s=t_loop,
                vectorised_s=t_vec, vectorised_compile_s=t_compile, speedup=t_loop / t_vec,
                speedup_including_compile=t_loop / (t_vec + t_compile),
                transfer_risk_loop=loop.mean(axis=0).tolist(), transfer_risk_vectorised=vec.mean(axis=0).tolist())


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(r["setting"], r["generator"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (setting, gen) in zip(axes[0], groups):
        sub = [r for r in rows if r["setting"] == setting and r["generator"] == gen and r.get("sampling") != "fixed"]
        styles = {1.0: ":", 3.0: "-.", 10.0: "--", 0: "-"}
        for key in sorted({(r["method"], r["epsilon"] or 0, r["q"] or 0) for r in sub}, key=str):
            pts = sorted((r["n_tasks"], r["transfer_risk"]) for r in sub
                         if (r["method"], r["epsilon"] or 0, r["q"] or 0) == key)
            m, e, q = key
            label = m + (f" eps={e:g}" if e else "") + (f" q={q}" if q and "local" not in m else "")
            color = ("black" if m == "local training" else "gray" if "local" in m else "tab:purple" if "FTMRL" in m
                     else {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}[q])
            ax.plot(*zip(*pts), marker="o", ms=3, label=label, color=color, ls=styles.get(e, "-"),
                    lw=2 if not e else 1.3)
        ax.set_yscale("log")
        ax.set_title(f"{setting} ({gen} features)")
        ax.set_xlabel("number of training tasks N")
        ax.set_ylabel("transfer risk (test MSE)")
        ax.legend(fontsize=6, ncol=2, title="colour: q / method, line: eps (solid = non-private)", title_fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 reps, N in {100, 400}")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--only-speed", action="store_true")
    p.add_argument("--add-relations", action="store_true",
                   help="only add ε under both neighbouring relations to the stored results file")
    args = p.parse_args(argv)
    if args.add_relations:
        add_relations(RESULTS_DIR / ("meta_transfer_risk_quick.json" if args.quick else "meta_transfer_risk.json"))
        return
    reps = 2 if args.quick else args.reps
    ns = [100, 400] if args.quick else [100, 200, 300, 400, 500, 600, 700]
    eps = [1.0, 3.0, 10.0, None]
    rows = []
    if args.only_speed:
        sp = [speed_benchmark(100, 2, eps, reps=2 if args.quick else 5, minibatch=mb) for mb in ("resample", "cycle")]
        write_results("meta_speed_quick" if args.quick else "meta_speed", sp, command=CMD + " --only-speed")
        print(json.dumps(sp, indent=1))
        return
    # the authors' generator: the notebook's budgets ε ∈ {3, 10, ∞}; fixed-size sampling (without
    # replacement, replace-one accounting) for its q = 2, ε = 10 row; DP-FTMRL at N ∈ {100, 400, 700}
    jobs = [("multi-cluster-authors-generator", [1, 2, 3], dict(epsilons=[3.0, 10.0, None])),
            ("single-cluster", [1], dict(ftmrl=True)), ("multi-cluster", [1, 2, 3], {}),
            ("multi-cluster-authors-generator", [2], dict(epsilons=[10.0], ns=ns[-1:], sampling="fixed",
                                                          local=False))]
    name = "meta_transfer_risk_quick" if args.quick else "meta_transfer_risk"
    paper = [dict(setting="multi-cluster", generator="authors", method="authors' notebook (q=2)", epsilon=e, q=2,
                  n_tasks=n, transfer_risk=v) for e, d in PAPER_AUTHORS_Q2.items() for n, v in d.items()]
    for setting, qs, kw in tqdm(jobs, desc="settings"):
        kw = {"epsilons": eps, "ns": ns, **kw}
        rows += run_grid(setting, qs, kw.pop("epsilons"), kw.pop("ns"), reps, **kw)
        write_results(name, rows, command=CMD, paper_reference=paper, delta=DELTA, learner=dict(  # after each setting
            lam=LAM, inner_steps=INNER_STEPS, inner_lr=INNER_LR, inner_batch=INNER_BATCH, meta_lr=META_LR,
            batch=BATCH, init_scale=INIT))
        plot(rows, RESULTS_DIR / f"{name}.png")
    if not args.skip_speed:
        sp = [speed_benchmark(100, 2, eps, reps=2 if args.quick else 5, minibatch=mb) for mb in ("resample", "cycle")]
        write_results("meta_speed_quick" if args.quick else "meta_speed", sp, command=CMD)
        print(json.dumps(sp, indent=1))
    for r in rows:
        if r["n_tasks"] in (100, 400, 700):
            print(f'{r["setting"]:14s} {r["generator"]:7s} {r["method"]:30s} eps={r["epsilon"]} q={r["q"]} '
                  f'N={r["n_tasks"]} risk={r["transfer_risk"]:.3f}±{r["transfer_risk_std"]:.3f}')


if __name__ == "__main__":
    main()
