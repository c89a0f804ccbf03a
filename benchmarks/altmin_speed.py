"""Speed of the per-task Gram build and of one full AdaDPALS step at ML-20M scale.

Everything is measured in one process, side by side: the dense-matmul throughput of this device
(the yardstick), the bucketed Gram build, the plain per-observation segment_sum baseline, and a full
AdaDPALS step (exact user solves for all users + private item update: Gram, noise, ridge solve), with
the item solve of `jdp` (Cholesky, adaptive ridge) and, for `--eigh-dims`, the PSD projection by
eigendecomposition it replaced; plus where the step's time goes (user Gram, user solves, item Gram,
Gram noise, item solve).

    PYTHONPATH=. python -m benchmarks.altmin_speed            # ML-20M size, d = 64 and 128
    PYTHONPATH=. python -m benchmarks.altmin_speed --quick    # small smoke run
"""
from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.altmin_solver import psd_eigh_solve
from benchmarks.common import write_results
from jdp.altmin.model import UserSolver
from jdp.data import planted_powerlaw
from jdp.multitask import gram, ssp
from jdp.multitask.ssp import _task_noise, ridge_solve, solve_tasks
from jdp.multitask.weights import adaptive_weights
from jdp.noise import clip_by_norm


def timed(fn, repeats=3):
    jax.block_until_ready(fn())  # compile + warm up
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def dense_gflops(n=4096):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / timed(lambda: f(a)) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--eigh-dims", type=int, nargs="*", default=[64],
                    help="dims at which to time the step with the replaced eigh solve too (it is slow)")
    ap.add_argument("--baseline-ratings", type=int, default=1_000_000,
                    help="segment_sum baseline runs on this many ratings (it is slow); GFLOP/s are comparable")
    args = ap.parse_args()
    size = dict(n_users=136_677, n_items=20_108, nnz=10_000_000)
    if args.quick:
        size = dict(n_users=5_000, n_items=1_000, nnz=200_000)
        args.baseline_ratings = 100_000
    t = time.perf_counter()
    data = planted_powerlaw(seed=0, **size).data
    print(f"data {data} in {time.perf_counter() - t:.1f}s")
    rng = np.random.default_rng(0)
    counts = jnp.asarray(data.item_counts().astype(np.float32) + rng.normal(0, 100, data.n_items).astype(np.float32))
    w = np.asarray(adaptive_weights(jnp.maximum(counts, 1.0), jnp.asarray(data.user), jnp.asarray(data.item),
                                    data.n_users, 100.0, 0.25))
    t = time.perf_counter()
    plan = gram.build_plan(data.item, data.user, w, data.n_items)
    plan_seconds = time.perf_counter() - t
    classes, stack_index = gram.device_arrays(plan, plan.slot_values(np.clip(data.rating - 3.5, -2.25, 2.25)))
    rows = []
    peak = dense_gflops()
    print(f"dense matmul: {peak:.1f} GFLOP/s; item plan built in {plan_seconds:.1f}s, padding x{plan.padded_rows / data.nnz:.3f}")
    for d in args.dims:
        u = clip_by_norm(jax.random.normal(jax.random.key(1), (data.n_users, d)) / math.sqrt(d), 1.0)
        v = np.asarray(jax.random.normal(jax.random.key(2), (data.n_items, d)) / math.sqrt(d))
        flops = 2 * data.nnz * d * d
        gram_fn = jax.jit(lambda f: gram.shard_gram(f, tuple((s[0], q[0], y[0]) for s, q, y in classes), stack_index[0]))
        t_gram = timed(lambda: gram_fn(u))
        # plain baseline on a prefix of the ratings
        nb = min(args.baseline_ratings, data.nnz)
        base = lambda: gram.segment_sum_gram(u, jnp.asarray(data.item[:nb]), jnp.asarray(data.user[:nb]),  # noqa: E731
                                             jnp.asarray(w[:nb]), jnp.asarray(data.rating[:nb]), data.n_items)
        t_base = timed(base, repeats=1)
        # full AdaDPALS step: user solves + private item update
        gt = jnp.asarray(plan.global_task)
        std_a, std_b = 80.0, 180.0
        lam = 2.0 * 2 * math.sqrt(d) * std_a  # fit()'s default item ridge (reg_scale 2)

        t = time.perf_counter()
        users = UserSolver(data, 3.5, 1.0)  # layout built once per run, like the item plan
        user_plan_seconds = time.perf_counter() - t

        def step():
            uu = clip_by_norm(users(v), 1.0)
            return solve_tasks(uu, classes, stack_index, gt, jax.random.key(3), std_a, std_b, lam, mesh=None, noisy=True)

        t_step = timed(step, repeats=2)
        t_users = timed(lambda: users(v), repeats=2)
        t_step_eigh = None
        if d in args.eigh_dims:  # the same step with the replaced solver, measured in the same run
            ssp.ridge_solve = psd_eigh_solve
            jax.clear_caches()
            t_step_eigh = timed(step, repeats=1)
            ssp.ridge_solve = ridge_solve
            jax.clear_caches()
        # where the step goes
        # user Grams block by block as UserSolver builds them, reduced to a scalar so they are not kept
        user_gram = jax.jit(lambda f: jax.lax.map(
            lambda cs: sum(jnp.sum(x) for x in gram.shard_gram(f, cs[0], cs[1])), (users.classes, users.stack_index)))
        t_user_gram = timed(lambda: user_gram(jnp.asarray(v)), repeats=2)
        t_user_solve = max(t_users - t_user_gram, 0.0)  # the rest of the user solves: Cholesky + substitution
        noise = jax.jit(lambda k: _task_noise(k, gt[0], d, std_a, std_b))
        t_noise = timed(lambda: noise(jax.random.key(4)), repeats=2)
        ia, ib = gram_fn(u)
        noise_a, noise_b = noise(jax.random.key(4))
        item_solve = jax.jit(lambda a, b: ridge_solve(a, b, lam, adaptive=True))
        t_item_solve = timed(lambda: item_solve(ia + noise_a, ib + noise_b), repeats=2)
        del ia, ib, noise_a, noise_b
        row = {
            "d": d, "n_users": data.n_users, "n_items": data.n_items, "nnz": data.nnz,
            "dense_matmul_gflops": peak,
            "gram_seconds": t_gram, "gram_gflops": flops / t_gram / 1e9, "gram_fraction_of_dense": flops / t_gram / 1e9 / peak,
            "segment_sum_ratings": nb, "segment_sum_seconds": t_base,
            "segment_sum_gflops": 2 * nb * d * d / t_base / 1e9,
            "segment_sum_fraction_of_dense": 2 * nb * d * d / t_base / 1e9 / peak,
            "speedup_vs_segment_sum": (t_base / nb) / (t_gram / data.nnz),
            "adadpals_step_seconds": t_step, "user_solve_seconds": t_users,
            "adadpals_step_seconds_eigh_psd": t_step_eigh, "item_ridge": lam, "gram_noise_std": std_a,
            "breakdown_seconds": {"user_gram": t_user_gram, "user_cholesky_solve": t_user_solve, "item_gram": t_gram,
                                  "item_gram_noise": t_noise, "item_cholesky_adaptive_solve": t_item_solve},
            "item_plan_seconds_once": plan_seconds, "user_plan_seconds_once": user_plan_seconds, "padding_factor": plan.padded_rows / data.nnz,
        }
        rows.append(row)
        print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()})
    path = write_results("altmin_speed" + ("_quick" if args.quick else ""), rows,
                         command="python -m benchmarks.altmin_speed" + (" --quick" if args.quick else ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
