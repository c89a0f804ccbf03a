"""Data-parallel DP-SGD on 4 host-platform devices equals one device, and one row moves the all-reduced clipped
sum by at most C whichever device holds it.

The 4-device run is a subprocess started with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the device
count is fixed when jax starts), with a timeout so that a collective's deadlock fails instead of hanging.
"""
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, optax
import flax.linen as nn
from jdp.clipping import dp_sgd
from jdp.clipping.sharding import data_mesh

assert len(jax.devices()) == 4, jax.devices()

class Net(nn.Module):
    @nn.compact
    def __call__(self, ids, x):
        h = nn.Embed(50, 8)(ids).mean(1) + nn.Dense(8)(x)
        h = nn.Conv(4, (3,), padding="SAME")(h[:, :, None]).reshape(h.shape[0], -1)
        return nn.Dense(1)(nn.tanh(h))[:, 0]

model = Net()
rng = np.random.default_rng(0)
N = 96
data = {"ids": rng.integers(0, 50, (N, 5)).astype(np.int32), "x": rng.normal(size=(N, 6)).astype(np.float32),
        "y": rng.normal(size=N).astype(np.float32)}
data["x"][7] *= 1e4  # one row far past the clip bound
params = model.init(jax.random.key(0), data["ids"][:1], data["x"][:1])

def loss_fn(p, b):
    return (model.apply(p, b["ids"], b["x"]) - b["y"]) ** 2

out = {}
mesh = data_mesh(4)
for method in ("auto", "ghost", "ghost-two-pass", "vmap"):
    for name, m in (("one", None), ("mesh", mesh)):
        dp = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=N, batch_size=24, l2_clip=0.5, delta=1e-3, steps=3,
                    noise_multiplier=1.0, method=method, mesh=m, max_batch_size=64)
        p, rep, hist = dp.fit(params, data, jax.random.key(1), progress=False)
        out[f"{method}_{name}"] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)])
        out[f"{method}_{name}_eps"] = np.array(rep.epsilon())
        out[f"{method}_{name}_loss"] = np.array([h["loss"] for h in hist])
    # one row's contribution to the all-reduced sum, on each device in turn (rows 0-15 device 0, ...)
    acc = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=N, batch_size=24, l2_clip=0.5, delta=1e-3, steps=3,
                 noise_multiplier=1.0, method=method, mesh=mesh, max_batch_size=64).accumulate
    zero = jax.tree.map(jnp.zeros_like, params)
    batch = jax.tree.map(lambda a: a[:64], data)
    full, _ = acc(params, zero, batch, jnp.ones(64, bool))
    diffs = []
    for row in (7, 20, 40, 63):
        b = jax.tree.map(lambda a: a.copy(), batch)
        b["x"][row] = data["x"][7]
        with_row, _ = acc(params, zero, b, jnp.ones(64, bool))
        without, _ = acc(params, zero, b, jnp.ones(64, bool).at[row].set(False))
        d = jax.tree.map(lambda a, c: a - c, with_row, without)
        diffs.append(float(jnp.sqrt(sum(jnp.sum(x.astype(jnp.float64) ** 2) for x in jax.tree.leaves(d)))))
    out[f"{method}_contrib"] = np.array(diffs)
try:
    dp_sgd(loss_fn, optax.sgd(0.1), num_examples=N, batch_size=24, l2_clip=0.5, delta=1e-3, steps=3,
           noise_multiplier=1.0, mesh=mesh, max_batch_size=62)
    out["refused"] = np.array(False)
except ValueError as e:
    out["refused"] = np.array("multiple of the 4 devices" in str(e))
np.savez(sys.argv[1], **out)
"""


@pytest.fixture(scope="module")
def four_devices(run_on_host_devices):
    return run_on_host_devices(SCRIPT, devices=4, timeout=900)


METHODS = ("auto", "ghost", "ghost-two-pass", "vmap")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_dp_sgd_on_four_devices_equals_one_device(four_devices, method):
    one, mesh = four_devices[f"{method}_one"], four_devices[f"{method}_mesh"]
    np.testing.assert_allclose(mesh, one, rtol=2e-5, atol=2e-6)
    assert float(four_devices[f"{method}_mesh_eps"]) == float(four_devices[f"{method}_one_eps"])
    np.testing.assert_allclose(four_devices[f"{method}_mesh_loss"], four_devices[f"{method}_one_loss"], rtol=1e-5)
    assert not np.allclose(one, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_one_row_moves_the_all_reduced_sum_by_at_most_c_on_every_device(four_devices, method):
    contrib = four_devices[f"{method}_contrib"]
    assert np.all(contrib <= 0.5 * (1 + 1e-5)), contrib
    assert np.all(contrib > 0.4), contrib  # the crafted row is clipped to about C, not dropped


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_the_mesh_is_refused(four_devices):
    assert bool(four_devices["refused"])


@pytest.mark.slow
def test_the_many_devices_example_of_the_guide_runs():
    """docs/clipping.md#many-devices runs as written (here on however many devices this process has)."""
    import re
    text = (ROOT / "docs" / "clipping.md").read_text()
    part = text.split("### Many devices\n", 1)[1].split("\n### ", 1)[0]
    code = re.search(r"```python\n(.*?)```", part, flags=re.S).group(1)
    exec(compile(code, "docs/clipping.md#many-devices", "exec"), {"__name__": "docs_many_devices"})
