import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp.clipping.optimizers import dp_adam_bc, noise_variance, scale_by_adam_bc


def _reference(grads, phi, b1, b2, gamma):
    """DP-AdamBC written plainly in float64 (the paper's update, one coordinate array at a time)."""
    m = v = np.zeros_like(grads[0])
    out = []
    for t, g in enumerate(grads, start=1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        out.append((m / (1 - b1 ** t)) / (np.sqrt(np.maximum(v / (1 - b2 ** t) - phi, gamma)) + 1e-8))
    return out


def test_adam_bc_matches_the_plain_update():
    rng = np.random.default_rng(0)
    phi, b1, b2 = 1e-4, 0.9, 0.99
    grads = [rng.normal(0.0, 0.02, size=(5, 3)) + np.linspace(-0.05, 0.05, 15).reshape(5, 3) for _ in range(12)]
    tx = scale_by_adam_bc(phi, b1, b2, gamma_over_noise=3.0)
    state = tx.init(jnp.zeros((5, 3)))
    want = _reference(grads, phi, b1, b2, 3.0 * phi)
    for g, w in zip(grads, want):
        u, state = tx.update(jnp.asarray(g, jnp.float32), state)
        np.testing.assert_allclose(np.asarray(u), w, rtol=2e-4, atol=1e-6)


def _walk(tx, steps=300, noise_std=1e-3, signal=0.0, seed=1):
    """Distance moved by the parameters under pure noise (plus a constant `signal`) after `steps` updates."""
    params = jnp.zeros(2000)
    state = tx.init(params)
    key = jax.random.PRNGKey(seed)
    update = jax.jit(tx.update)
    for _ in range(steps):
        key, sub = jax.random.split(key)
        g = signal + noise_std * jax.random.normal(sub, params.shape)
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def test_adam_bc_stops_the_noise_walk_that_adam_makes_and_keeps_adams_step_on_signal():
    noise_std = 1e-3
    adam = optax.adam(1e-2)
    bc = dp_adam_bc(1e-2, noise_std ** 2, gamma_over_noise=100.0)
    # pure noise: Adam moves each coordinate by ~its step size whatever the noise scale; AdamBC by √(φ/γ) of it
    walk_adam = float(jnp.sqrt(jnp.mean(_walk(adam) ** 2)))
    walk_bc = float(jnp.sqrt(jnp.mean(_walk(bc) ** 2)))
    assert walk_bc < 0.2 * walk_adam
    # a signal 20x the noise: both take Adam's step in the signal's direction
    drift_adam = float(jnp.mean(_walk(adam, signal=-2e-2)))
    drift_bc = float(jnp.mean(_walk(bc, signal=-2e-2)))
    assert drift_bc == pytest.approx(drift_adam, rel=0.05) and drift_bc > 0


def test_noise_variance_and_refusals():
    assert noise_variance(2.0, 1.5, 1000.0) == pytest.approx((2.0 * 1.5 / 1000.0) ** 2)
    with pytest.raises(ValueError, match="noise_var"):
        scale_by_adam_bc(-1e-6)
    with pytest.raises(ValueError, match="gamma_over_noise"):
        scale_by_adam_bc(1e-6, gamma_over_noise=-1.0)
    with pytest.raises(ValueError, match="b2"):
        scale_by_adam_bc(1e-6, b2=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        noise_variance(float("nan"), 1.0, 10.0)


def test_adam_bc_keeps_the_parameter_dtype_and_float32_moments():
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    tx = dp_adam_bc(1e-3, 1e-6, weight_decay=1e-4)
    state = tx.init(params)
    u, state = tx.update({"w": jnp.full((3,), 0.5, jnp.bfloat16)}, state, params)
    assert u["w"].dtype == jnp.bfloat16
    assert state[0].nu["w"].dtype == jnp.float32


def test_without_noise_adam_bc_is_adam():
    rng = np.random.default_rng(3)
    params = jnp.zeros(6)
    bc, adam = scale_by_adam_bc(0.0), optax.scale_by_adam()
    s_bc, s_adam = bc.init(params), adam.init(params)
    for _ in range(5):
        g = jnp.asarray(rng.normal(size=6), jnp.float32)
        u_bc, s_bc = bc.update(g, s_bc)
        u_adam, s_adam = adam.update(g, s_adam)
        np.testing.assert_allclose(np.asarray(u_bc), np.asarray(u_adam), rtol=1e-6)
