"""Speed of the per-task Gram build and of one full AdaDPALS step at ML-20M scale.

Everything is measured in one process, side by side: the dense-matmul throughput of this device
(the yardstick), the bucketed Gram build, the plain per-observation segment_sum baseline, and a full
AdaDPALS step as `jdp.altmin.fit` runs it (exact user solves for all users with their biases, then the
private item update on features [clip(u), γ₀]: Gram, noise, adaptive ridge solve), beside the same step
written the simple way it was before (the class Grams concatenated into one [tasks, d+1, d+1] array, per-task
noise drawn inside a vmap, one batched solve); plus where the step's time goes. Peers for the Gram's kernel on the
same pre-gathered classes: numpy's stacked matmul (its BLAS) and, when the `mkl` wheel is installed (extra
bench-altmin), MKL's batched GEMM.

    PYTHONPATH=. python -m benchmarks.altmin.speed            # ML-20M size, d = 64 and 128
    PYTHONPATH=. python -m benchmarks.altmin.speed --quick    # small smoke run
    PYTHONPATH=. python -m benchmarks.altmin.speed --dims 64 --kernels-only   # the Gram's kernel and its peers
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_results
from jdp.altmin.model import UserSolver
from jdp.data import planted_powerlaw
from jdp.multitask import gram
from jdp.multitask.ssp import _task_ridge, ridge_solve, solve_tasks
from jdp.multitask.weights import adaptive_weights
from jdp.noise import clip_by_norm, keyed_gram_noise, symmetric_gaussian


def timed(fn, repeats=3, with_first=False):
    """Best of `repeats` steady calls (seconds); with_first: also the first call's (trace + compile + run)."""
    t = time.perf_counter()
    jax.block_until_ready(fn())  # compile + warm up
    first = time.perf_counter() - t
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return (best, first) if with_first else best


def dense_gflops(n=4096):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / timed(lambda: f(a)) / 1e9


def batched_matmul_seconds(plan, d: int) -> tuple[float, float, list[dict]]:
    """The Gram's ceiling on this layout: XLA's batched matmul einsum('nld,nle->nde') ALONE (input already
    gathered and weighted, so no gather) over the plan's padded length classes, one scan batch per class timed
    and scaled by the class's number of batches (as `gram.class_gram` runs it); beside it the peer, numpy's
    stacked `matmul` (one BLAS GEMM per task) on the same batches. Returns XLA's total, numpy's total and, per
    class, its row length, tasks, real rows and both rates on its padded rows."""
    mm = jax.jit(lambda x: jnp.einsum("nld,nle->nde", x, x))
    total, total_np, per_class = 0.0, 0.0, []
    for c in plan.classes:
        n, length = c.src.shape[1], c.src.shape[2]
        batch = min(n, max(1, gram.ROWS_PER_BATCH // length))
        x = jax.random.normal(jax.random.key(length), (batch, length, d), jnp.float32)
        x_np = np.asarray(x)
        x_np_t = np.ascontiguousarray(x_np.transpose(0, 2, 1))
        t = timed(lambda: mm(x))
        t_np = timed(lambda: np.matmul(x_np_t, x_np))
        total += t * (n / batch)
        total_np += t_np * (n / batch)
        flops = 2 * batch * length * d * d
        per_class.append({"rows": int(length), "tasks": int((c.task < plan.n_tasks).sum()), "real_rows": int((c.obs >= 0).sum()),
                          "matmul_gflops": flops / t / 1e9, "numpy_matmul_gflops": flops / t_np / 1e9})
    return total, total_np, per_class


def _mkl_library():
    """MKL's runtime library (libmkl_rt, Linux) when the `mkl` wheel is installed (`pip install mkl`, the extra
    bench-altmin), else None: the peer is optional, jdp never uses it."""
    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        c_int, ptr = ctypes.c_int, ctypes.c_void_p  # LP64 interface: 32-bit integers
        lib.cblas_sgemm.argtypes = [c_int] * 6 + [ctypes.c_float, ptr, c_int, ptr, c_int, ctypes.c_float, ptr, c_int]
        lib.cblas_sgemm_batch_strided.argtypes = ([c_int] * 6 + [ctypes.c_float, ptr, c_int, c_int, ptr, c_int, c_int,
                                                  ctypes.c_float, ptr, c_int, c_int, c_int])
        lib.cblas_sgemm.restype = lib.cblas_sgemm_batch_strided.restype = None
        return lib
    return None


ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS enums


def mkl_batched_matmul_seconds(plan, d: int, lib) -> tuple[float, float, list[float]]:
    """The best BLAS peer found for this shape: MKL's batched GEMM (`cblas_sgemm_batch_strided`, which threads across
    the batch, unlike XLA's batched dot and numpy's stacked matmul) on the same pre-gathered padded classes and scan
    batches as `batched_matmul_seconds`, no gather. Returns its total, MKL's own dense rate and its GFLOP/s per class."""
    # inputs from numpy, not jax: XLA's worker threads spin for a while after a program and would share the cores
    n = 4096
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    c = np.empty_like(a)
    dense = 2 * n**3 / timed(lambda: lib.cblas_sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, n, n, n, 1.0, a.ctypes.data, n,
                                                     a.ctypes.data, n, 0.0, c.ctypes.data, n)) / 1e9
    total, per_class = 0.0, []
    for cl in plan.classes:
        tasks, length = cl.src.shape[1], cl.src.shape[2]
        batch = min(tasks, max(1, gram.ROWS_PER_BATCH // length))
        x = np.random.default_rng(length).standard_normal((batch, length, d), np.float32)
        g = np.empty((batch, d, d), np.float32)
        t = timed(lambda: lib.cblas_sgemm_batch_strided(ROW_MAJOR, TRANS, NO_TRANS, d, d, length, 1.0, x.ctypes.data, d,
                                                        length * d, x.ctypes.data, d, length * d, 0.0, g.ctypes.data,
                                                        d, d * d, batch))
        if not np.allclose(g[0], x[0].T @ x[0], rtol=1e-4, atol=1e-3):
            raise AssertionError("MKL's batched GEMM disagrees with numpy")
        total += t * (tasks / batch)
        per_class.append(2 * batch * length * d * d / t / 1e9)
    return total, dense, per_class


def numpy_dense_gflops(n=4096):
    a = np.asarray(jax.random.normal(jax.random.key(0), (n, n), jnp.float32))
    return 2 * n**3 / timed(lambda: a @ a) / 1e9


def _numpy_blas() -> str:
    """The BLAS numpy calls (name and version), for the record."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - only a label
        return "unknown"


def simple_item_update(feats, classes, stack_index, global_task, key, std_a, std_b, lam):
    """The item update written the simple way (how jdp ran it before): every class Gram concatenated into one
    [tasks, d, d] array in slot order, per-task noise drawn inside a vmap, one batched adaptive solve."""
    a, b = gram.shard_gram(feats, classes, stack_index)
    d = feats.shape[1]

    def one(t):
        ka, kb = jax.random.split(jax.random.fold_in(key, t))
        return symmetric_gaussian(ka, (), d, std_a), std_b * jax.random.normal(kb, (d,))
    na, nb = jax.vmap(one)(global_task)
    a, b = a + na, b + nb
    return ridge_solve(a, b, _task_ridge(a, lam, jnp.asarray([0.0, 0.0, 0.0, 1.0, 0.0])), adaptive=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--baseline-ratings", type=int, default=1_000_000,
                    help="segment_sum baseline runs on this many ratings (it is slow); GFLOP/s are comparable")
    ap.add_argument("--kernels-only", action="store_true",
                    help="only the Gram build and its kernel peers on the same classes (no step), a few minutes")
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
    labels = plan.slot_values(np.clip(data.rating - 3.5, -2.25, 2.25))
    classes, stack_index = gram.device_arrays(plan, labels)
    tasks = gram.class_tasks(plan)
    one_shard = tuple((s[0], q[0], y[0]) for s, q, y in classes)
    rows = []
    peak = dense_gflops()
    peak_np = numpy_dense_gflops()
    numpy_blas = _numpy_blas()
    print(f"dense matmul: {peak:.1f} GFLOP/s; item plan built in {plan_seconds:.1f}s, padding x{plan.padded_rows / data.nnz:.3f}")
    for d in args.dims:
        # item-update features as fit() builds them: [clip(u_j, 1), γ₀ = 1] (d + 1 columns)
        u = clip_by_norm(jax.random.normal(jax.random.key(1), (data.n_users, d)) / math.sqrt(d), 1.0)
        feats = jnp.concatenate([u, jnp.ones((data.n_users, 1))], axis=1)
        v = np.asarray(jax.random.normal(jax.random.key(2), (data.n_items, d)) / math.sqrt(d))
        c = np.zeros(data.n_items, np.float32)
        flops = 2 * data.nnz * (d + 1) ** 2
        gram_fn = jax.jit(lambda f: [gram.class_gram(f, *cl) for cl in one_shard])
        t_gram = timed(lambda: gram_fn(feats))
        t_matmul, t_matmul_np, matmul_classes = batched_matmul_seconds(plan, d + 1)
        mkl = _mkl_library()
        if mkl is not None:
            t_matmul_mkl, peak_mkl, mkl_rates = mkl_batched_matmul_seconds(plan, d + 1, mkl)
            for cls, rate in zip(matmul_classes, mkl_rates):
                cls["mkl_matmul_gflops"] = rate
        kernels = {
            "d": d, "n_users": data.n_users, "n_items": data.n_items, "nnz": data.nnz, "padding_factor": plan.padded_rows / data.nnz,
            "dense_matmul_gflops": peak,
            "gram_seconds": t_gram, "gram_gflops": flops / t_gram / 1e9, "gram_fraction_of_dense": flops / t_gram / 1e9 / peak,
            "batched_matmul_alone_seconds": t_matmul, "batched_matmul_alone_fraction_of_dense": flops / t_matmul / 1e9 / peak,
            "batched_matmul_alone_by_class": matmul_classes,
            # the peers on the same pre-gathered classes: numpy's stacked matmul (BLAS), against numpy's own dense
            # rate, and MKL's batched GEMM when installed
            "numpy_blas": numpy_blas, "numpy_dense_matmul_gflops": peak_np,
            "numpy_batched_matmul_alone_seconds": t_matmul_np,
            "numpy_batched_matmul_alone_fraction_of_numpy_dense": flops / t_matmul_np / 1e9 / peak_np,
            **({} if mkl is None else {
                "mkl_dense_matmul_gflops": peak_mkl, "mkl_batched_matmul_alone_seconds": t_matmul_mkl,
                "mkl_batched_matmul_alone_fraction_of_mkl_dense": flops / t_matmul_mkl / 1e9 / peak_mkl,
                "mkl_batched_matmul_alone_fraction_of_dense": flops / t_matmul_mkl / 1e9 / peak}),
        }
        if args.kernels_only:
            rows.append(kernels)
            print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in kernels.items() if k != "batched_matmul_alone_by_class"}, flush=True)
            continue
        # plain baseline on a prefix of the ratings
        nb = min(args.baseline_ratings, data.nnz)
        base = lambda: gram.segment_sum_gram(feats, jnp.asarray(data.item[:nb]), jnp.asarray(data.user[:nb]),  # noqa: E731
                                             jnp.asarray(w[:nb]), jnp.asarray(data.rating[:nb]), data.n_items)
        t_base = timed(base, repeats=1)
        std_a, std_b = 80.0, 180.0
        lam = 2.0 * 2 * math.sqrt(d + 1) * std_a  # fit()'s default item ridge scale (reg_scale 2)

        t = time.perf_counter()
        users = UserSolver(data, 1.0, 5.0)  # layout built once per run, like the item plan
        users.class_layout()
        user_plan_seconds = time.perf_counter() - t

        def user_features():
            solved = users(v, c, 3.5)
            return jnp.concatenate([clip_by_norm(jnp.asarray(solved.factors), 1.0), jnp.ones((data.n_users, 1))], axis=1)

        def step():
            return solve_tasks(user_features(), classes, tasks, stack_index, jax.random.key(3), std_a, std_b, lam,
                               mesh=None, noisy=True)

        simple = jax.jit(lambda f, k: simple_item_update(f, one_shard, stack_index[0], jnp.asarray(plan.global_task[0]),
                                                         k, std_a, std_b, lam))
        t_step, t_step_first = timed(step, repeats=2, with_first=True)
        t_step_simple = timed(lambda: simple(user_features(), jax.random.key(3)), repeats=2)
        t_users = timed(user_features, repeats=2)
        # where the step goes: user Grams block by block as UserSolver builds them (reduced to a scalar so
        # they are not kept), the rest of the user solves, the item Gram, its noise, the item solve
        vb = jnp.concatenate([jnp.asarray(v), jnp.full((data.n_items, 1), users.bias_column)], axis=1)
        user_gram = jax.jit(lambda f: jax.lax.map(
            lambda cs: sum(jnp.sum(a) for cl in cs for a in gram.class_gram(f, *cl)), users.class_layout()[0]))
        t_user_gram = timed(lambda: user_gram(vb), repeats=2)
        all_tasks = jnp.concatenate([t[0] for t in tasks])
        noise = jax.jit(lambda k: keyed_gram_noise(k, all_tasks, d + 1, std_a, std_b))
        t_noise = timed(lambda: noise(jax.random.key(4)), repeats=2)
        # one batched solve of every item's Gram, as solve_tasks runs it
        item_solve = jax.jit(lambda a, b: ridge_solve(a, b, lam, adaptive=True))
        grams = gram_fn(feats)
        a_all, b_all = jnp.concatenate([g[0] for g in grams]), jnp.concatenate([g[1] for g in grams])
        del grams
        t_item_solve = timed(lambda: item_solve(a_all, b_all), repeats=2)
        row = {
            **kernels,
            "segment_sum_ratings": nb, "segment_sum_seconds": t_base,
            "segment_sum_gflops": 2 * nb * (d + 1) ** 2 / t_base / 1e9,
            "segment_sum_fraction_of_dense": 2 * nb * (d + 1) ** 2 / t_base / 1e9 / peak,
            "speedup_vs_segment_sum": (t_base / nb) / (t_gram / data.nnz),
            "adadpals_step_seconds": t_step, "adadpals_step_seconds_simple": t_step_simple, "user_solve_seconds": t_users,
            "adadpals_step_compile_seconds": max(t_step_first - t_step, 0.0),  # first step minus a steady one
            "item_ridge": lam, "gram_noise_std": std_a,
            "breakdown_seconds": {"user_gram": t_user_gram, "user_cholesky_solve": max(t_users - t_user_gram, 0.0),
                                  "item_gram": t_gram, "item_gram_noise": t_noise, "item_cholesky_adaptive_solve": t_item_solve},
            "item_plan_seconds_once": plan_seconds, "user_plan_seconds_once": user_plan_seconds,
        }
        rows.append(row)
        print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
    name = "altmin_speed" + ("_kernels" if args.kernels_only else "") + ("_quick" if args.quick else "")
    path = write_results(name, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
