"""Sharded item updates on 4 host-platform devices equal the single-device results.

The sharded runs happen in a subprocess started with XLA_FLAGS=--xla_force_host_platform_device_count=4
(the device count is fixed when jax starts) and a timeout, so a deadlock fails the test instead of
blocking the suite. jaxlib's CPU LAPACK kernels deadlocked inside shard_map on such a mesh (jax 0.10.2);
`ridge_solve` uses plain jnp ops there.
"""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.multitask.ssp import ridge_solve

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
import jax
import numpy as np
from jdp.altmin import AltMinConfig, fit
from jdp.data import planted_powerlaw
from jdp.multitask import ssp, weights as W
import jax.numpy as jnp

assert len(jax.devices()) == 4, jax.devices()
out = {}
# big enough that the LAPACK kernels would split their batch across the thread pool (the deadlock)
train = planted_powerlaw(seed=1, n_users=3000, n_items=1200, nnz=150_000, rank=4).data
for method, kw in (("ada-dpals", dict(epsilon=3.0)), ("als", {})):
    base = dict(method=method, steps=2, dim=16, show_progress=False, **kw)
    out[method + "_default"] = fit(train, AltMinConfig(**base), seed=0).item_factors
    out[method + "_1"] = fit(train, AltMinConfig(n_shards=1, **base), seed=0).item_factors

rng = np.random.default_rng(0)
m, n, d = 40, 800, 6
u = rng.normal(size=(n, d)); u /= np.maximum(1, np.linalg.norm(u, axis=1, keepdims=True))
user, task = np.nonzero(rng.random((n, m)) < np.linspace(0.05, 0.9, m)[None, :])
x, y = u[user], rng.normal(size=user.size)
w = np.asarray(W.clip_user_weights(jnp.ones(m), jnp.asarray(user), jnp.asarray(task), n, 10.0))
kw = dict(beta=10.0, clip_x=1.0, clip_y=1.0, noise_multiplier=0.5, lam=1.0)
for shards in (1, 4):
    out[f"ssp_{shards}"] = np.asarray(ssp.task_weighted_ssp(jax.random.key(1), task, user, x, y, w, m, n,
                                                            n_shards=shards, **kw))
np.savez(sys.argv[1], **out)
"""


@pytest.fixture(scope="module")
def four_devices(run_on_host_devices):
    return run_on_host_devices(SCRIPT, devices=4, timeout=240)


@pytest.mark.slow  # a 4-device subprocess: CI runs it (make test-slow)
@pytest.mark.parametrize("method", ["ada-dpals", "als"])
def test_default_fit_on_four_devices_equals_one_shard(four_devices, method):
    v4, v1 = four_devices[method + "_default"], four_devices[method + "_1"]
    assert np.all(np.isfinite(v4)) and np.std(v4) > 0.05
    np.testing.assert_allclose(v4, v1, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
def test_task_weighted_ssp_four_shards_equals_one(four_devices):
    t1, t4 = four_devices["ssp_1"], four_devices["ssp_4"]
    assert np.abs(t1).max() > 0.1
    np.testing.assert_allclose(t4, t1, rtol=1e-5, atol=1e-6)


def _reference(a, b, lam, adaptive):
    """float64: the first τ of 0, λ/4, λ/2, λ, … with a + τI positive definite (0 unless adaptive), then solve."""
    out = []
    for ai, bi in zip(a.astype(np.float64), b.astype(np.float64)):
        tau = 0.0
        while adaptive and np.linalg.eigvalsh(ai + tau * np.eye(len(bi))).min() <= 0:
            tau = max(2 * tau, lam / 4)
        out.append(np.linalg.solve(ai + (lam + tau) * np.eye(len(bi)), bi))
    return np.asarray(out)


@pytest.mark.parametrize("adaptive", [False, True])
def test_ridge_solve_lapack_and_jnp_agree_with_float64_reference(adaptive):
    rng = np.random.default_rng(0)
    t, d, lam = 60, 7, 1.0
    x = rng.normal(size=(t, 12, d))
    x[:20, 5:] = 0  # 20 rank-5 Grams: with noise these are indefinite
    a = np.einsum("tld,tle->tde", x, x)
    if adaptive:
        z = rng.normal(size=(t, d, d))
        a = a + 0.7 * (np.triu(z) + np.swapaxes(np.triu(z, 1), 1, 2))
        assert sum(np.linalg.eigvalsh(ai).min() < 0 for ai in a) >= 20  # the fallback is exercised
    b = rng.normal(size=(t, d))
    ref = _reference(a, b, lam, adaptive)
    for lapack in (True, False):
        got = jax.jit(lambda a, b: ridge_solve(a, b, lam, adaptive, lapack))(jnp.asarray(a, jnp.float32),
                                                                             jnp.asarray(b, jnp.float32))
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_ridge_solve_equals_psd_projection_when_the_gram_is_psd():
    """On a PSD Gram the adaptive ridge solve is exactly the paper's (PSD(Â) + λI)⁻¹ b̂."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 20, 5))
    a, b = np.einsum("tld,tle->tde", x, x), rng.normal(size=(30, 5))
    e, v = np.linalg.eigh(a)
    psd = np.einsum("tij,tj->ti", v, np.einsum("tji,tj->ti", v, b) / (np.maximum(e, 0) + 0.5))
    got = ridge_solve(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 0.5, adaptive=True)
    np.testing.assert_allclose(np.asarray(got), psd, rtol=1e-4, atol=1e-6)
