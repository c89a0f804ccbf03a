import numpy as np
import pytest

from jdp.data import SyntheticTasks, appendix_c, planted_movielens, planted_powerlaw


def test_appendix_c_statistics():
    s = appendix_c(seed=0, n_users=4000)
    d = s.data
    assert isinstance(s, SyntheticTasks) and (d.n_users, d.n_items) == (4000, 100)
    assert s.user_factors.shape == (4000, 5) and s.task_params.shape == (100, 5)
    assert s.user_factors.dtype == np.float32 and s.task_params.dtype == np.float32
    assert np.linalg.norm(s.user_factors, axis=1).max() <= 1 + 1e-6
    assert np.linalg.norm(s.task_params, axis=1).max() <= 1 + 1e-6
    # popularity sums to 20 (no clipping needed at these sizes) and expected nnz = n_users * 20
    assert abs(s.popularity.sum() - 20.0) < 1e-9 and s.popularity.max() <= 1.0
    assert abs(d.nnz - 4000 * 20) < 5 * np.sqrt(4000 * 20)
    # per-task counts follow q_i * n_users
    counts = d.item_counts()
    assert np.abs(counts - s.popularity * 4000).max() < 6 * np.sqrt(4000 * 0.5)
    # labels = <u, theta> + N(0, 1e-6): residual std ~ 1e-3
    resid = d.rating - s.expected_rating(d.user, d.item)
    assert 0.8e-3 < resid.std() < 1.2e-3
    # no duplicate (user, task) pairs; deterministic in the seed
    assert np.unique(d.user.astype(np.int64) * 100 + d.item).size == d.nnz
    again = appendix_c(seed=0, n_users=4000)
    assert np.array_equal(again.data.rating, d.rating) and np.array_equal(again.data.item, d.item)


def test_appendix_c_skew_a1_vs_a2():
    # q = U^(1/a): a = 1 is uniform (CV 0.577), a = 2 is Beta(2, 1) (CV 0.354): a = 1 is more skewed.
    cv = {a: np.mean([np.std(q) / np.mean(q) for q in
                      (appendix_c(seed=s, n_users=200, a=a).popularity for s in range(5))]) for a in (1.0, 2.0)}
    assert cv[1.0] > cv[2.0] + 0.1
    assert abs(cv[1.0] - 0.577) < 0.1 and abs(cv[2.0] - 0.354) < 0.1


@pytest.mark.parametrize("kwargs, name", [(dict(a=0.0), "a"), (dict(n_users=0), "n_users"),
                                          (dict(label_noise=-1.0), "label_noise"), (dict(dim=2.5), "dim"),
                                          (dict(total_popularity=np.inf), "total_popularity")])
def test_appendix_c_invalid(kwargs, name):
    with pytest.raises(ValueError, match=name):
        appendix_c(**kwargs)


def test_planted_powerlaw_small():
    n_users, n_items, nnz = 3000, 1000, 150_000
    s = planted_powerlaw(seed=0, n_users=n_users, n_items=n_items, nnz=nnz, rank=8)
    d = s.data
    assert (d.n_users, d.n_items, d.nnz) == (n_users, n_items, nnz)
    assert s.user_factors.shape == (n_users, 8) and s.task_params.shape == (n_items, 8)
    codes = d.user.astype(np.int64) * n_items + d.item
    assert np.all(np.diff(codes) > 0)  # sorted by (user, item) and no duplicate pairs
    assert d.rating.min() >= 0.5 and d.rating.max() <= 5.0
    assert abs(d.rating.mean() - 3.5) < 0.1 and 0.8 < d.rating.std() < 1.1
    # long tail: the top 10% items hold most ratings, the bottom half little
    c = np.sort(d.item_counts())[::-1]
    assert c[: n_items // 10].sum() / nnz > 0.4
    assert c[n_items // 2:].sum() / nnz < 0.2
    # popularity is p_i (sums to 1) and realised counts follow it (Spearman-like check on ranks)
    assert abs(s.popularity.sum() - 1) < 1e-9
    top_true = np.argsort(-s.popularity)[:50]
    assert np.isin(top_true, np.argsort(-d.item_counts())[:100]).mean() > 0.9
    # user activity is skewed too, every user appears
    uc = np.sort(d.user_counts())
    assert uc[-1] > 5 * uc[n_users // 2] and uc[0] > 0
    # planted structure: residuals against the planted model are ~ noise_std (except clipped ratings)
    resid = d.rating - s.expected_rating(d.user, d.item)
    inside = (d.rating > 0.5) & (d.rating < 5.0)
    assert 0.45 < resid[inside].std() < 0.55
    again = planted_powerlaw(seed=0, n_users=n_users, n_items=n_items, nnz=nnz, rank=8)
    assert np.array_equal(again.data.item, d.item) and np.array_equal(again.data.rating, d.rating)


def test_planted_powerlaw_invalid():
    with pytest.raises(ValueError, match="nnz"):
        planted_powerlaw(n_users=10, n_items=10, nnz=101)
    with pytest.raises(ValueError, match="rating_scale"):
        planted_powerlaw(n_users=10, n_items=10, nnz=10, rating_scale=(5.0, 1.0))
    with pytest.raises(ValueError, match="exponent"):
        planted_powerlaw(n_users=10, n_items=10, nnz=10, exponent=-1.0)


def test_planted_movielens_small():
    n_users, n_items, nnz = 4000, 1500, 200_000
    s = planted_movielens(seed=0, n_users=n_users, n_items=n_items, nnz=nnz, rank=6)
    d = s.data
    assert (d.n_users, d.n_items, d.nnz) == (n_users, n_items, nnz)
    assert s.user_factors.shape == (n_users, 8) and s.task_params.shape == (n_items, 8)  # rank + bias columns
    codes = d.user.astype(np.int64) * n_items + d.item
    assert np.all(np.diff(codes) > 0)
    assert d.rating.min() >= 0.5 and d.rating.max() <= 5.0
    assert abs(d.rating.mean() - 3.5) < 0.15 and 0.85 < d.rating.std() < 1.1
    # log-normal marginals: a real tail of rare items (median far below the mean, unlike Zipf(1)) and
    # skewed users
    c = d.item_counts()
    assert np.median(c) < 0.3 * c.mean() and (c < 0.05 * c.mean()).mean() > 0.1
    uc = d.user_counts()
    assert np.median(uc) < 0.7 * uc.mean() and uc.max() > 10 * np.median(uc)
    # planted biases: popular items are rated higher (correlation ~0.4 with log popularity), user
    # bias spread ~0.4; the bias columns are [c_j, 1] and [1, b_i]
    item_bias, user_bias = s.task_params[:, -1], s.user_factors[:, -2]
    assert np.all(s.user_factors[:, -1] == 1) and np.all(s.task_params[:, -2] == 1)
    assert 0.25 < np.corrcoef(np.log(s.popularity), item_bias)[0, 1] < 0.55
    assert 0.45 < item_bias.std() < 0.55 and 0.37 < user_bias.std() < 0.43
    # realised per-item mean ratings follow the planted bias (items with ≥ 50 ratings)
    item_mean = np.bincount(d.item, d.rating, n_items) / np.maximum(c, 1)
    busy = c >= 50
    assert np.corrcoef(item_mean[busy], item_bias[busy])[0, 1] > 0.8
    resid = d.rating - s.expected_rating(d.user, d.item)
    inside = (d.rating > 0.5) & (d.rating < 5.0)
    assert 0.6 < resid[inside].std() < 0.75
    again = planted_movielens(seed=0, n_users=n_users, n_items=n_items, nnz=nnz, rank=6)
    assert np.array_equal(again.data.item, d.item) and np.array_equal(again.data.rating, d.rating)


@pytest.mark.parametrize("kwargs, name", [(dict(popularity_bias_corr=1.5), "popularity_bias_corr"),
                                          (dict(item_bias_std=-0.1), "item_bias_std"),
                                          (dict(nnz=101), "nnz"), (dict(rank=0), "rank")])
def test_planted_movielens_invalid(kwargs, name):
    with pytest.raises(ValueError, match=name):
        planted_movielens(**{**dict(n_users=10, n_items=10, nnz=10), **kwargs})
