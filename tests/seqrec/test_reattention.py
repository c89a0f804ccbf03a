"""Re-Attention: variance propagation vs Monte-Carlo, zero-noise identity, effective errors, histogram."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp import accounting
from jdp.seqrec import models
from jdp.seqrec import reattention as ra

MC = 100_000


def _mc_var(f, shape_in, mu, var, key, n=MC):
    x = mu + jnp.sqrt(var) * jax.random.normal(key, (n,) + shape_in)
    y = f(x)
    return np.asarray(y.mean(0)), np.asarray(y.var(0))


def test_linear_variance_matches_monte_carlo():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    p, q, n = 6, 4, 60_000
    x0 = jax.random.normal(k1, (p,))
    vx = jax.random.uniform(k2, (p,), minval=0.01, maxval=0.2)
    W0 = jax.random.normal(k3, (p, q)) * 0.5
    wv = 0.03
    kx, kw, kb = jax.random.split(k4, 3)
    x = x0 + jnp.sqrt(vx) * jax.random.normal(kx, (n, p))
    W = W0 + jnp.sqrt(wv) * jax.random.normal(kw, (n, p, q))
    b = jnp.sqrt(wv) * jax.random.normal(kb, (n, q))
    y = jnp.einsum("np,npq->nq", x, W) + b
    pred = ra.linear_var(x0[None], vx[None], W0, wv)[0]
    np.testing.assert_allclose(np.asarray(y.var(0)), np.asarray(pred), rtol=0.04)


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_activation_moments_match_monte_carlo(act):
    mu = jnp.array([-1.5, -0.3, 0.0, 0.4, 2.0])
    var = jnp.array([0.01, 0.1, 1.0, 0.5, 2.0])
    f = jax.nn.relu if act == "relu" else (lambda z: jax.nn.gelu(z, approximate=False))
    m_mc, v_mc = _mc_var(f, (5,), mu, var, jax.random.key(1))
    m, v = ra.activation_moments(act, mu, var)
    np.testing.assert_allclose(np.asarray(m), m_mc, rtol=0.02, atol=2e-3)
    np.testing.assert_allclose(np.asarray(v), v_mc, rtol=0.03, atol=1e-5)
    # Paper Table 3: ReLU on N(0, 1) has variance 0.3408 (analytic).
    assert abs(float(ra.relu_moments(jnp.array(0.0), jnp.array(1.0))[1]) - 0.3408) < 1e-3
    # zero variance: deterministic
    m0, v0 = ra.activation_moments(act, mu, jnp.zeros(5))
    np.testing.assert_allclose(np.asarray(m0), np.asarray(f(mu)), atol=1e-5)
    assert float(jnp.abs(v0).max()) < 1e-6


def test_layernorm_rule_matches_monte_carlo_for_small_noise():
    d = 16
    k1, k2, k3, k4 = jax.random.split(jax.random.key(2), 4)
    x0 = jax.random.normal(k1, (d,)) * 1.5 + 0.3
    vx = jax.random.uniform(k2, (d,), minval=1e-4, maxval=4e-3)
    gamma = 1.0 + 0.3 * jax.random.normal(k3, (d,))
    wv = 1e-4

    def ln(x, g, b):
        m = x.mean(-1, keepdims=True)
        return g * (x - m) / jnp.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-6) + b

    kx, kg, kb = jax.random.split(k4, 3)
    x = x0 + jnp.sqrt(vx) * jax.random.normal(kx, (MC, d))
    g = gamma + jnp.sqrt(wv) * jax.random.normal(kg, (MC, d))
    b = jnp.sqrt(wv) * jax.random.normal(kb, (MC, d))
    v_mc = np.asarray(ln(x, g, b).var(0))
    pred = np.asarray(ra.layernorm_var(x0[None], vx[None], gamma, wv)[0])
    np.testing.assert_allclose(pred, v_mc, rtol=0.06)  # first-order rule; noise is small here
    # The naive "scale by γ²/Var_LN" rule (no Jacobian projection) is measurably worse in aggregate.
    naive = np.asarray(gamma ** 2 * vx / (x0.var() + 1e-6) + wv * 0 + wv)
    assert np.abs(pred - v_mc).sum() < np.abs(naive - v_mc).sum()


def test_logit_correction_unbiases_expected_attention_weight():
    """E[exp(q·K/√d)] with K ~ N(k, diag v) equals exp(q·k/√d + correction): the correction removes it."""
    dh = 4
    q = jnp.array([0.8, -0.5, 1.2, 0.3])
    k = jnp.array([0.1, 0.4, -0.2, 0.5])
    v = jnp.array([0.3, 0.1, 0.5, 0.2])
    K = k + jnp.sqrt(v) * jax.random.normal(jax.random.key(3), (MC, dh))
    mc = float(jnp.exp(K @ q / jnp.sqrt(dh)).mean())
    corr = float(ra.attention_logit_correction(q[None, None, None], v[None, None, None])[0, 0, 0, 0])
    assert abs(np.log(mc) - (float(q @ k) / 2.0 + corr)) < 0.01
    assert corr > 0.05


def _tiny_transformer(reattention, norm="pre", ffn_dim=None):
    return models.make_model("dpformer" if reattention else "transformer", n_items=30, maxlen=7, d=8,
                             heads=2, blocks=2, dropout=0.0, norm=norm, ffn_dim=ffn_dim)


@pytest.mark.parametrize("norm,ffn_dim", [("pre", None), pytest.param("post", 32, marks=pytest.mark.slow)])
def test_zero_noise_reattention_is_identity_and_noise_changes_attention(norm, ffn_dim):
    seq = jnp.array([[0, 0, 3, 7, 1, 29, 5], [4, 4, 9, 2, 11, 30, 8]])
    vanilla, dpf = _tiny_transformer(False, norm, ffn_dim), _tiny_transformer(True, norm, ffn_dim)
    params = jax.jit(vanilla.init)(jax.random.key(0), seq)
    zero = {"w_var": 0.0, "emb_var": jnp.zeros(31)}

    @jax.jit
    def attn_and_logits(params, reatt):
        logits, st = dpf.apply(params, seq, reatt=reatt, mutable=["intermediates"])
        return logits, st["intermediates"]["block0"]["attn"]["attention"][0]

    base = jax.jit(vanilla.apply)(params, seq)
    l0, a0 = attn_and_logits(params, zero)
    np.testing.assert_allclose(np.asarray(l0), np.asarray(base), atol=1e-6)
    # Large variance on item 29's embedding: the attention weight on its key must drop.
    emb_var = jnp.zeros(31).at[29].set(0.5)
    noisy = {"w_var": 1e-6, "emb_var": emb_var}
    _, a1 = attn_and_logits(params, noisy)
    # row 0, queries at positions >= 5 attending key position 5 (item 29)
    assert bool(jnp.all(a1[0, :, 6, 5] < a0[0, :, 6, 5]))
    # a shorter left-padded window (length buckets) gives the same outputs at real positions
    short, full = jax.jit(lambda p: (dpf.apply(p, seq[:1, -5:], reatt=noisy), dpf.apply(p, seq[:1], reatt=noisy)))(params)
    np.testing.assert_allclose(np.asarray(short[0]), np.asarray(full[0, -5:]), atol=1e-5)


def test_effective_variances_and_private_histogram():
    counts = np.array([0.0, 100.0, 10.0, -3.0])
    w_var, emb = ra.effective_variances(2.0, 1.0, batch_size=50, sampling_rate=0.5, item_counts=counts)
    assert w_var == pytest.approx((2.0 / 50) ** 2)
    np.testing.assert_allclose(emb, [0.0, (2 / (0.5 * 100)) ** 2, (2 / (0.5 * 10)) ** 2, (2 / 0.5) ** 2], rtol=1e-6)
    w0, e0 = ra.effective_variances(0.0, 1.0, 50, 0.5, counts)
    assert w0 == 0 and not e0.any()
    rep = accounting.PrivacyReport(1e-5)
    exact = np.arange(1001, dtype=float)
    noisy = ra.private_item_counts(jax.random.key(0), exact, max_items_per_user=16, noise_multiplier=2.0, report=rep)
    assert noisy[0] == 0.0
    assert np.std(noisy[1:] - exact[1:]) == pytest.approx(8.0, rel=0.1)  # 2 * sqrt(16)
    (rel,) = rep.releases
    assert rel.sensitivity == 4.0 and rel.noise_scale == 8.0
    assert rep.epsilon() == pytest.approx(accounting.compute_epsilon(accounting.gaussian_event(2.0), 1e-5))
    with pytest.raises(ValueError, match="noise_multiplier"):
        ra.private_item_counts(jax.random.key(0), exact, 16, 0.0, rep)
    with pytest.raises(ValueError, match="item_counts"):
        ra.effective_variances(1.0, 1.0, 10, 0.1, np.array([np.nan, 1.0]))
