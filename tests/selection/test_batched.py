"""Mechanism API tests: jit/vmap of the per-problem functions, batch fast paths vs exact probabilities,
stopping-time laws, correlation measures, recommender."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jdp import selection as S
from jdp.selection import generalized_em as G
from jdp.selection import random_stop as RS


def _instance(k=40, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=k).astype(np.float32) * 0.3
    d = rng.uniform(0.05, 1.0, size=k).astype(np.float32)
    return q, d


def _chi2_pvalue(idx, p, merge_below=5.0):
    """Chi-square p-value, pooling cells with expected count < merge_below into one."""
    n = len(idx)
    counts = np.bincount(np.asarray(idx), minlength=len(p)).astype(float)
    exp = n * p
    small = exp < merge_below
    obs = np.append(counts[~small], counts[small].sum())
    ex = np.append(exp[~small], exp[small].sum())
    keep = ex > 0
    return stats.chisquare(obs[keep], ex[keep] * obs[keep].sum() / ex[keep].sum()).pvalue


@pytest.mark.parametrize("name,params", [
    ("gem", {}), ("mgem", {}), ("combined-gem", {}),
    ("rs-geometric", {}),                      # Poissonized dense sampler
    ("rs-tnb", {"eta": 0.5}),                  # Poissonized, Gamma mixing + redraw of K = 0
    ("rs-tnb", {"eta": 0.0}),                  # logarithmic K: flattened stream of draws
    ("rs-geometric", {"gamma": 0.5}),          # E[K] = 2 << k: flattened stream of draws
])
def test_batch_fast_paths_match_exact_probabilities(name, params):
    """k = 40 takes the O(k·m) hull-chain path (GEM family) and the batch samplers of RS_γ."""
    q, d = _instance()
    n = 20_000
    p = S.probabilities(name, q, d, 2.0, **params)
    idx = S.select(name, jax.random.key(3), np.tile(q, (n, 1)), np.tile(d, (n, 1)), 2.0, **params)
    assert idx.shape == (n,) and idx.dtype == jnp.int32
    assert _chi2_pvalue(idx, p) > 1e-3


def test_gem_overflow_rows_fall_back_to_dense():
    """frontier_size=2 makes most rows overflow; outputs must still follow the exact law."""
    rng = np.random.default_rng(1)
    k, n = 40, 20_000
    d = np.sort(rng.uniform(0.05, 1.0, size=k)).astype(np.float32)
    q = np.sqrt(d).astype(np.float32)  # concave in Δ: every point is a hull vertex
    _, overflow = G.gem_scores_frontier(jnp.asarray(q), jnp.asarray(d), -3.0, 2)  # mGEM-like shift
    assert bool(overflow)
    p = S.probabilities("mgem", q, d, 1.0)
    idx = S.select("mgem", jax.random.key(5), np.tile(q, (n, 1)), d, 1.0, frontier_size=2)
    assert _chi2_pvalue(idx, p) > 1e-3


def test_gem_few_overflow_rows_redone_in_the_same_pass():
    """~1% of rows have a hull chain longer than the frontier: they are redone densely inside the
    compiled pass (capacity batch/64), and follow the exact law (the truncated chain would not)."""
    rng = np.random.default_rng(2)
    k, n, n_long = 40, 64_000, 900
    t = G.default_shift(k, 1.0, negative=True)
    d = np.geomspace(1e-3, 1.0, k).astype(np.float32)
    q_long = (0.3 * np.log(d) + t * d).astype(np.float32)  # b = q − t·d concave in Δ: k hull vertices
    q = (2 * t * d + 0.01 * rng.normal(size=(n, k))).astype(np.float32)  # b falls with Δ: short chains
    long_rows = rng.choice(n, n_long, replace=False)
    q[long_rows] = q_long
    _, overflow = G.gem_scores_frontier(jnp.asarray(q), jnp.asarray(d), t, 8)
    assert 0 < int(overflow.sum()) <= n // 64 and bool(overflow[long_rows].all())
    idx = np.asarray(S.select("mgem", jax.random.key(6), q, d, 1.0))
    assert _chi2_pvalue(idx[long_rows], S.probabilities("mgem", q_long, d, 1.0)) > 1e-3


def test_softmax_sampler_skips_zero_probability_candidates():
    from jdp.selection.rnm import sample_softmax
    logits = jnp.array([[-jnp.inf, 0.0, -jnp.inf, -1e30], [3.0, -jnp.inf, -jnp.inf, -jnp.inf]])
    draws = jax.vmap(lambda k: sample_softmax(k, logits))(jax.random.split(jax.random.key(0), 2000))
    assert bool(jnp.all(draws[:, 0] == 1)) and bool(jnp.all(draws[:, 1] == 0))


def test_per_problem_functions_jit_and_vmap():
    q, d = _instance(k=12, seed=2)
    qs = jnp.asarray(np.stack([q, -q, q * 2]))
    keys = jax.random.split(jax.random.key(0), 3)
    fns = [S.rnm_exponential, S.rnm_gumbel, S.rnm_laplace, S.exponential_mechanism, S.permute_and_flip,
           S.krr, S.uniform, S.gem, S.mgem, S.combined_gem, S.random_stopping]
    # one compiled function vmapping every mechanism (one compilation keeps the test fast)
    all_fns = jax.jit(lambda k, q, dd, e: [jax.vmap(fn, in_axes=(0, 0, None, None))(k, q, dd, e) for fn in fns])
    for out in all_fns(keys, qs, jnp.asarray(d), 1.0):
        assert out.shape == (3,) and out.dtype == jnp.int32 and bool(jnp.all((out >= 0) & (out < 12)))
    # frontier path with its in-kernel dense fallback equals the dense path for the same key
    a = S.gem(keys[0], jnp.asarray(q), jnp.asarray(d), 0.5, frontier_size=2)
    b = S.gem(keys[0], jnp.asarray(q), jnp.asarray(d), 0.5)
    assert int(a) == int(b)
    # huge ε: every private mechanism (but uniform/krr-with-k) returns the argmax
    big = [S.rnm_exponential, S.exponential_mechanism, S.permute_and_flip, S.gem, S.mgem]
    outs = jax.jit(lambda k, q, dd: [fn(k, q, dd, 1e4) for fn in big])(keys[1], jnp.asarray(q), jnp.full(12, 1e-3))
    assert all(int(o) == int(np.argmax(q)) for o in outs)


@pytest.mark.parametrize("stopping, eta, gamma", [("geometric", 1.0, 0.1), ("tnb", 0.0, 0.1), ("tnb", 2.0, 0.3)])
def test_stopping_time_mean(stopping, eta, gamma):
    keys = jax.random.split(jax.random.key(11), 20_000)
    ks = np.asarray(jax.vmap(lambda kk: RS.sample_stopping_time(kk, gamma, stopping, eta))(keys))
    assert ks.min() >= 1
    mean = RS.expected_stopping_time(gamma, stopping, eta)
    assert abs(ks.mean() - mean) < 5 * ks.std() / np.sqrt(len(ks)), (ks.mean(), mean)
    if stopping == "tnb" and eta == 0.0:  # logarithmic law: P[K=1] = (1−γ)/ln(1/γ)
        assert abs((ks == 1).mean() - (1 - gamma) / np.log(1 / gamma)) < 0.01


def test_exact_probabilities_are_distributions_and_match_known_identities():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(10, 30))
    d = rng.uniform(0.1, 1.0, size=(10, 30))
    for name in S.PRIVATE_MECHANISMS:
        p = S.probabilities(name, q, d, 0.8)
        assert p.shape == q.shape and np.all(p >= 0)
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-9)
    # permute-and-flip = exponential-noise RNM; Gumbel RNM = exponential mechanism
    np.testing.assert_allclose(S.probabilities("pf", q, d, 0.8), S.probabilities("rnm-exp", q, d, 0.8))
    np.testing.assert_allclose(S.probabilities("rnm-gumbel", q, d, 0.8), S.probabilities("em", q, d, 0.8))
    # kRR closed form
    p = S.probabilities("krr", q, d, 0.8)
    np.testing.assert_allclose(p.max(-1), np.exp(0.8) / (np.exp(0.8) + 29))
    # GEM utility theorem: w.p. ≥ 1 − β the selected score ≥ max_b (q_b − 4Δ_b ln(k/β)/ε)
    beta, eps = 0.2, 0.8
    p = S.probabilities("gem", q, d, eps, beta=beta)
    thresh = np.max(q - 4 * d * np.log(30 / beta) / eps, axis=-1, keepdims=True)
    assert np.all((p * (q >= thresh)).sum(-1) >= 1 - beta)


def test_correlations_and_recommender():
    rng = np.random.default_rng(4)
    d = rng.uniform(0.1, 1.0, size=200)
    q_pos = d + 0.05 * rng.normal(size=200)
    np.testing.assert_allclose(float(S.spearman(q_pos, d)), stats.spearmanr(q_pos, d).statistic, atol=1e-5)
    np.testing.assert_allclose(float(S.pearson(q_pos, d)), stats.pearsonr(q_pos, d).statistic, atol=1e-5)
    ties = np.array([1.0, 1.0, 2.0, 3.0, 3.0, 0.5])
    other = np.array([0.2, 0.1, 0.5, 0.4, 0.9, 0.3])
    np.testing.assert_allclose(float(S.spearman(ties, other)), stats.spearmanr(ties, other).statistic, atol=1e-6)
    # the sign bit of combined GEM: JAX and NumPy twins agree with scipy, ties and near-zero ρ included
    from jdp.selection.correlation import spearman_positive, spearman_positive_np
    x = np.round(rng.normal(size=(400, 30)), 1)  # many ties
    y = np.round(rng.normal(size=(400, 30)), 1)
    ref = np.array([stats.spearmanr(a, b).statistic > 0 for a, b in zip(x, y)])
    np.testing.assert_array_equal(spearman_positive_np(x, y), ref)
    np.testing.assert_array_equal(np.asarray(spearman_positive(jnp.asarray(x), jnp.asarray(y))), ref)
    shared = np.array([stats.spearmanr(a, y[0]).statistic > 0 for a in x])  # one Δ vector for all rows
    np.testing.assert_array_equal(spearman_positive_np(x, y[0]), shared)
    big_x = np.tile(x, (4, 1))  # > 1,024 rows: the blocked, threaded path
    np.testing.assert_array_equal(spearman_positive_np(big_x, np.tile(y, (4, 1))), np.tile(ref, 4))
    assert float(S.weighted_correlation(q_pos, d)) > 0.5
    assert float(S.weighted_correlation(-q_pos, d)) < -0.5
    assert float(S.spearman(np.ones(5), np.arange(5.0))) == 0.0  # constant: 0, not NaN
    assert S.recommend_mechanism_nonprivate(q_pos, d)["mechanism"] == "mgem"
    assert S.recommend_mechanism_nonprivate(-q_pos, d)["mechanism"] == "gem"
    assert S.recommend_mechanism_nonprivate(rng.normal(size=200), d)["mechanism"] == "rnm-exp"


def test_hybrid_counter_noise_and_dp_quantile():
    from jdp.selection import bandit as BD
    T, eps = 256, 1.0
    draws = np.stack([BD.hybrid_counter_noise(jax.random.key(s), T, eps) for s in range(120)])
    assert draws.shape == (120, T + 1) and np.all(draws[:, 0] == 0)
    # at n = 2^j only the logarithmic part: j + 1 Laplace(2/ε) terms, variance 8(j + 1)/ε²
    for j in (3, 6):
        emp = draws[:, 1 << j].var()
        assert 0.5 < emp / (8 * (j + 1) / eps**2) < 1.6
    # n = 2^7 + 3: log part (8 terms) + 2 tree nodes of B_7, each Laplace(7·2/ε): variance 8·8 + 2·2·14²
    emp = draws[:, 128 + 3].var()
    assert 0.5 < emp / (8 * 8 + 2 * 2 * 14.0**2) < 1.6
    x = jnp.asarray(np.random.default_rng(0).uniform(0.2, 0.4, size=64).astype(np.float32))
    mask = jnp.arange(64) < 50
    qs = np.array([float(BD.dp_quantile(jax.random.key(s), x, mask, 0.5, 5.0, 0.0, 1.0)) for s in range(30)])
    assert np.all((qs >= 0) & (qs <= 1)) and abs(np.median(qs) - float(np.median(np.asarray(x)[:50]))) < 0.05


def test_bandit_learners_run_and_account():
    from jdp.selection import bandit as BD
    b = BD.ShiftBandit(horizon=300, shift_at=150)
    r = b.rewards(0)
    ucb = BD.run_learner("ucb", b, r, jax.random.key(0))
    assert ucb["privacy"] is None and 0 < ucb["cumulative_reward"] <= 300
    for learner in ("dp-ucb", "window-gem"):
        out = BD.run_learner(learner, b, r, jax.random.key(1), epsilon=4.0, window=50, period=25)
        assert abs(out["privacy"]["pure_epsilon"] - 4.0) < 1e-9
        assert out["cumulative_reward"] > 0.3 * out["oracle_reward"]
    with pytest.raises(ValueError, match="not differentially private"):
        BD.run_learner("window-rnmh-nonprivate", b, r, jax.random.key(0))


def test_select_composes_with_jit_and_vmap():
    """`select` inside jax.jit equals its eager form (same key, same float64 sampler; one mechanism per batched
    path), under jax.vmap it follows
    the exact output probabilities, invalid rows give -1 in the graph, and without x64 it refuses rather than
    sampling in float32."""
    q = np.random.default_rng(0).normal(size=(6, 40))
    d = np.full(40, 0.5)
    key = jax.random.key(0)
    with jax.enable_x64(True):
        for name in ("em", "gem", "rs-geometric"):  # the three batched paths: generic, GEM frontier, random stopping
            eager = np.asarray(S.select(name, key, q, d, 1.0))
            jitted = np.asarray(jax.jit(lambda k, s, n=name: S.select(n, k, s, d, 1.0))(key, jnp.asarray(q)))
            np.testing.assert_array_equal(jitted, eager, err_msg=name)
        bad = q.copy()
        bad[2, 3] = np.nan
        out = np.asarray(jax.jit(lambda k, s: S.select("em", k, s, d, 1.0))(key, jnp.asarray(bad)))
        assert out[2] == -1 and np.all(out[[0, 1, 3, 4, 5]] >= 0)
        # vmap over keys of one small problem: empirical frequencies match the exact probabilities
        small, sens = np.array([0.0, -1.0, -2.5, -0.3]), np.array([1.0, 0.5, 2.0, 1.0])
        n = 20_000
        for name in ("gem",):
            draws = np.asarray(jax.jit(jax.vmap(lambda k, n_=name: S.select(n_, k, small, sens, 1.5)))(
                jax.random.split(jax.random.key(1), n)))
            freq = np.bincount(draws, minlength=4) / n
            p = np.asarray(S.probabilities(name, small, sens, 1.5))
            assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3), (name, freq, p)
    with pytest.raises(ValueError, match="x64"):
        jax.jit(lambda k, s: S.select("em", k, s, d, 1.0))(key, jnp.asarray(q, jnp.float32))
    with pytest.raises(ValueError, match="concrete"):
        jax.jit(lambda e: S.select("em", key, q, d, e))(1.0)
