import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp import metrics, noise


def test_symmetric_gaussian_is_symmetric_with_stated_variance():
    z = np.asarray(noise.symmetric_gaussian(jax.random.key(0), (4000,), 3, 2.0))
    assert np.allclose(z, np.swapaxes(z, 1, 2))
    for i, j in [(0, 0), (0, 1), (1, 2), (2, 2)]:
        assert np.std(z[:, i, j]) == pytest.approx(2.0, rel=0.05)
    assert abs(np.corrcoef(z[:, 0, 1], z[:, 0, 2])[0, 1]) < 0.05


def test_add_gaussian_tree_every_entry_independent_with_stated_std_and_dtype():
    # leaves of several shapes and dtypes (one draw per dtype, sliced): each entry N(0, std²), no entry
    # of one leaf correlated with another's, dtypes and shapes kept, the same key reproduces the noise
    tree = {"w": jnp.zeros((3000, 4)), "b": jnp.zeros((4,)), "s": jnp.zeros(()), "h": jnp.zeros((3000, 4), jnp.bfloat16),
            "e": jnp.zeros((0, 5))}
    keys = jax.random.split(jax.random.key(3), 400)
    out = jax.vmap(lambda k: noise.add_gaussian_tree(k, tree, 2.0))(keys)
    assert {k: (v.shape[1:], v.dtype) for k, v in out.items()} == {k: (v.shape, v.dtype) for k, v in tree.items()}
    w, b, s = np.asarray(out["w"]), np.asarray(out["b"]), np.asarray(out["s"])
    h = np.asarray(out["h"], np.float32)
    for z in (w[:, :50].ravel(), b.ravel(), s, h[:, :50].ravel()):
        assert np.std(z) == pytest.approx(2.0, rel=0.1) and abs(np.mean(z)) < 0.4
    # entries adjacent in the one draw (last of w, first of b) and across leaves are uncorrelated
    for x, y in [(w[:, -1, -1], b[:, 0]), (b[:, -1], s), (w[:, 0, 0], h[:, 0, 0]), (w[:, 0, 0], w[:, 0, 1])]:
        assert abs(np.corrcoef(x, y)[0, 1]) < 0.2
    again = noise.add_gaussian_tree(keys[0], tree, 2.0)
    assert np.array_equal(np.asarray(again["w"]), w[0]) and np.array_equal(np.asarray(again["b"]), b[0])
    assert noise.add_gaussian_tree(keys[0], {}, 1.0) == {}


def test_add_gaussian_tree_is_the_one_sliced_draw_under_jit_for_every_key():
    # the draw is materialised behind a conditional on a key bit (a fusion boundary on CPU): whichever
    # branch a key takes, typed or raw, eager or jitted, the noise is the plain draw of fold_in(key, 0)
    tree = {"a": jnp.zeros((3, 4)), "b": jnp.zeros(5)}
    jitted = jax.jit(noise.add_gaussian_tree, static_argnums=2)
    parities = set()
    for seed in range(6):
        for key in (jax.random.key(seed), jax.random.PRNGKey(seed)):
            parities.add(int(np.ravel(jax.random.key_data(key))[-1]) % 2)
            plain = 2.0 * jax.random.normal(jax.random.fold_in(key, 0), (17,))
            for out in (noise.add_gaussian_tree(key, tree, 2.0), jitted(key, tree, 2.0)):
                got = jnp.concatenate([out["a"].ravel(), out["b"]])
                assert np.array_equal(np.asarray(got), np.asarray(plain))
    assert parities == {0, 1}


def test_clip_by_norm_and_psd_project():
    x = jnp.array([[3.0, 4.0], [0.3, 0.4]])
    assert np.allclose(noise.clip_by_norm(x, 1.0), [[0.6, 0.8], [0.3, 0.4]])
    a = jnp.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3, -1
    p = np.asarray(noise.psd_project(a))
    assert np.linalg.eigvalsh(p).min() >= -1e-6
    assert np.allclose(p, 1.5 * np.ones((2, 2)), atol=1e-5)
    # a unit's contribution: clipped like clip_by_norm, a non-finite vector (entry or norm) becomes 0, never NaN
    c = np.asarray(noise.clip_contribution(jnp.array([[3.0, 4.0], [np.inf, 1.0], [np.nan, 0.0], [3e38, 3e38]]), 1.0))
    assert np.allclose(c, [[0.6, 0.8], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]) and np.all(np.isfinite(c))


def test_rmse_and_mae_with_mask():
    pred, target = jnp.array([1.0, 2.0, 9.0]), np.array([1.0, 4.0, 0.0])
    assert metrics.rmse(pred, target, jnp.array([1, 1, 0])) == pytest.approx(np.sqrt(2.0))
    assert metrics.mae(pred, target, np.array([True, True, False])) == pytest.approx(1.0)
    assert metrics.rmse(pred, target) == pytest.approx(np.sqrt(85 / 3)) and metrics.mae(pred, target) == pytest.approx(11 / 3)
    assert np.isnan(metrics.rmse(pred, target, np.zeros(3, bool))) and np.isnan(metrics.mae(pred, target, np.zeros(3, bool)))
    with pytest.raises(ValueError, match="same shape"):
        metrics.rmse(pred, target[:2])
    with pytest.raises(ValueError, match="mask"):
        metrics.mae(pred, target, np.ones(2, bool))


def test_ranking_metrics_hand_made():
    scores = jnp.array([[0.9, 0.8, 0.7, 0.1], [0.1, 0.2, 0.3, 0.4]])
    targets = jnp.array([[False, True, False, True], [True, False, False, False]])
    # user 0: top-2 = {0, 1}: one hit; denominator min(2, 2) = 2
    r = np.asarray(metrics.recall_at_k(scores, targets, 2))
    assert r[0] == pytest.approx(0.5) and r[1] == pytest.approx(0.0)
    # history exclusion: removing item 0 of user 0 brings item 3? no: top-2 = {1, 2}
    ex = jnp.array([[True, False, False, False], [False, False, False, False]])
    assert float(metrics.recall_at_k(scores, targets, 2, ex)[0]) == pytest.approx(0.5)
    n = np.asarray(metrics.ndcg_at_k(scores, targets, 2))
    assert n[0] == pytest.approx((1 / np.log2(3)) / (1 + 1 / np.log2(3)))
    h = np.asarray(metrics.hit_at_k(scores, targets, 3))
    assert list(h) == [1.0, 0.0]
    # denominator min(k, |targets|): one target, k = 3, hit -> 1
    assert float(metrics.recall_at_k(scores, jnp.array([[False, True, False, False]] * 2), 3)[0]) == 1.0
    assert np.isnan(float(metrics.recall_at_k(scores, jnp.zeros((2, 4), bool), 2)[0]))


def test_rank_of_target():
    scores = jnp.array([[0.1, 0.5, 0.9, 0.3]])
    assert int(metrics.rank_of_target(scores, jnp.array([1]))[0]) == 1
    ex = jnp.array([[False, False, True, False]])
    assert int(metrics.rank_of_target(scores, jnp.array([1]), ex)[0]) == 0


def test_rank_of_target_counts_nan_against_the_target():
    """A NaN target score gave rank -1 (a hit at every k): it now ranks last; a NaN elsewhere ranks above it."""
    nan = jnp.nan
    scores = jnp.array([[0.1, nan, 0.9, 0.3], [0.1, nan, 0.9, 0.3]])
    ranks = metrics.rank_of_target(scores, jnp.array([1, 3]))
    assert ranks.tolist() == [3, 2]
    targets = jnp.array([[False, True, False, False]] * 2)
    for fn in (metrics.recall_at_k, metrics.ndcg_at_k, metrics.hit_at_k):
        assert fn(scores, targets, 2).tolist() == [0.0, 0.0], fn.__name__  # top_k puts NaN first: no hit


def test_popularity_buckets_and_sliced_rmse():
    counts = np.array([50, 1, 7, 3, 100, 2, 9, 20, 4, 5])
    b = metrics.popularity_buckets(counts, 5)
    assert list(np.bincount(b)) == [2] * 5
    assert b[1] == 0 and b[4] == 4
    item = np.array([1, 4, 4])
    out = metrics.sliced_rmse(np.array([1.0, 2.0, 2.0]), np.array([0.0, 2.0, 0.0]), item, b, 5)
    assert out[0] == pytest.approx(1.0) and out[4] == pytest.approx(np.sqrt(2.0)) and np.isnan(out[2])
    with pytest.raises(ValueError, match="n_buckets"):
        metrics.popularity_buckets(counts, 11)


def test_gaussian_histogram_is_the_one_histogram_release():
    """noise.gaussian_histogram: every bin gets N(0, std²); numpy counts are released in float64 on the host,
    jax counts on device in their dtype, and both draw the same standard normals from the same key."""
    key = jax.random.key(3)
    counts = np.arange(20_000, dtype=np.float64) % 7
    host = noise.gaussian_histogram(key, counts, 2.5)
    dev = noise.gaussian_histogram(key, jnp.asarray(counts, jnp.float32), 2.5)
    assert isinstance(host, np.ndarray) and host.dtype == np.float64 and dev.dtype == jnp.float32
    z = (host - counts) / 2.5
    assert abs(z.mean()) < 4 / np.sqrt(z.size) and abs(z.std() - 1) < 0.03
    np.testing.assert_allclose(np.asarray(dev, np.float64), host, atol=1e-5)


@pytest.mark.parametrize("partitionable", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_flat_draws_are_the_same_numbers_as_shaped_ones(partitionable):
    """`standard_normal` / `standard_uniform` draw flat and reshape (a faster compile on CPU): the numbers must be
    exactly `jax.random.normal` / `uniform`'s, under either threefry counter layout, so seeds reproduce the same
    runs as before."""
    from jdp.noise import standard_normal, standard_uniform
    with jax.threefry_partitionable(partitionable):
        for shape in [(), (5,), (3, 4), (2, 3, 4), (7, 1, 3)]:
            key = jax.random.key(11)
            np.testing.assert_array_equal(standard_normal(key, shape), jax.random.normal(key, shape))
            np.testing.assert_array_equal(standard_uniform(key, shape), jax.random.uniform(key, shape))
        np.testing.assert_array_equal(standard_normal(key, (4, 6), jnp.bfloat16),
                                      jax.random.normal(key, (4, 6), jnp.bfloat16))
