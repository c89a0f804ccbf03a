"""Released sums of bounded contributions are computed in full float32 on every platform.

Worst neighbour: one unit (example, user, task) whose contribution sits exactly at its bound. On GPUs JAX's
default float32 matmuls use TF32, which rounds that contribution by up to ~1e-3 relative, past the
sensitivity the accountant uses: an H200 measured a task's meta-gradient in the released sum at 1.0000135·C
(`test_meta_privacy`), an H100 one example's clipped gradient at 1.00036·C. CPUs have no TF32, so these
tests read the compiled program instead: every matrix product in the code that forms a released sum must
carry precision HIGHEST, which is what keeps the bound on a GPU.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jdp.clipping as jc
from jdp import meta as M
from jdp import noise
from jdp.meta import engine as meta_engine
from jdp.multitask import gram


def matmul_precisions(fn, *args) -> list[str]:
    """The precision of every dot_general in fn's lowered (StableHLO) program, traced at the DEFAULT setting."""
    with jax.default_matmul_precision("default"):
        text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"stablehlo\.dot_general[^\n]*precision = \[(\w+), (\w+)\]", text)


def assert_all_highest(fn, *args):
    found = matmul_precisions(fn, *args)
    assert found, "no matrix product found: the check would pass vacuously"
    assert all(p == ("HIGHEST", "HIGHEST") for p in found), found


def test_the_check_sees_a_default_precision_matmul():
    """The reader itself: a plain matmul lowers at DEFAULT (TF32 on a GPU), one under exact_matmuls at HIGHEST."""
    x = jnp.ones((3, 3))
    assert matmul_precisions(lambda a: a @ a, x) == [("DEFAULT", "DEFAULT")]

    def exact(a):
        with noise.exact_matmuls():
            return a @ a
    assert_all_highest(exact, x)


def test_meta_routed_sum_of_clipped_task_gradients():
    """Every meta method (meta-NSGD, DP-FTMRL, private clustering) releases `engine.routed_sum` plus noise; meta-NSGD
    runs it inside `engine.train`, whose whole program is checked too."""
    key = jax.random.PRNGKey(0)
    tasks = M.single_cluster_regression(key, 5, n_points=6, dim=3, mean=1.0)[0]
    spec = meta_engine.FlatSpec.of(jnp.zeros(3))
    h = jnp.stack([jnp.zeros(3), jnp.ones(3)])
    keys = jax.random.split(key, 5)
    fn = lambda data, mask, h: meta_engine.routed_sum(M.RidgeLearner(lam=0.8), spec, h, data, mask, keys,
                                                        jnp.ones(5), 1.5)
    assert_all_highest(fn, tasks.data, tasks.mask, h)
    for sampling in ("poisson", "fixed"):  # meta-NSGD's whole noisy training program (engine.train)
        run = lambda data, mask, h, s=sampling: meta_engine.train(
            key, data, mask, h, learner=M.RidgeLearner(lam=0.8), spec=spec, batch_size=2, sampling=s, steps=2,
            n_active=5, meta_lr=0.5, l2_clip=1.5, noise_std=1.0, radius=jnp.inf)
        assert_all_highest(run, tasks.data, tasks.mask, h)


def test_task_weighted_gram_of_user_features():
    """SSP and every ALS item update release per-task Grams A_i = Σ_j w_ij x_j x_jᵀ (and b_i) plus noise."""
    rng = np.random.default_rng(0)
    task = rng.integers(0, 6, 40)
    plan = gram.build_plan(task, rng.integers(0, 10, 40), rng.uniform(0.1, 1.0, 40), 6)
    classes, stack_index = gram.device_arrays(plan, plan.slot_values(rng.normal(size=40)))
    feats = jnp.asarray(rng.normal(size=(10, 4)), jnp.float32)
    assert_all_highest(lambda f: gram.shard_gram(f, [tuple(v[0] for v in c) for c in classes], stack_index[0]),
                       feats)


def test_clipped_gradient_sum_by_default():
    """DP-SGD (and seqrec's DP step) release `clipped_grad`'s sum; its default matmul_precision is "highest"."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))

    x = jax.random.normal(jax.random.PRNGKey(1), (6, 5))
    batch = {"x": x, "y": jnp.arange(6) % 3}
    model = Net()
    params = model.init(jax.random.PRNGKey(2), x[:1])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], axis=1)[:, 0]

    assert_all_highest(lambda p, b: jc.clipped_grad(loss_fn, p, b, l2_clip=1.0).grad_sum, params, batch)
    # ...and the reader would flag it at the caller's TF32 setting
    found = matmul_precisions(lambda p, b: jc.clipped_grad(loss_fn, p, b, l2_clip=1.0, matmul_precision=None).grad_sum,
                              params, batch)
    assert ("DEFAULT", "DEFAULT") in found
