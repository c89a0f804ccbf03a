import numpy as np
import pytest

from jdp.data import Interactions, concat


def _small():
    return Interactions(user=np.array([2, 0, 1, 0, 2]), item=np.array([1, 3, 0, 0, 3]),
                        rating=np.array([5.0, 3.0, 4.0, 1.0, 4.5]), n_users=4, n_items=5,
                        timestamp=np.array([10, 20, 30, 40, 50]))


def test_dtypes_and_readonly():
    d = _small()
    assert d.user.dtype == np.int32 and d.item.dtype == np.int32
    assert d.rating.dtype == np.float32 and d.timestamp.dtype == np.int64
    assert d.nnz == 5 and len(d) == 5
    with pytest.raises(ValueError):
        d.rating[0] = 1.0  # read-only view
    with pytest.raises(Exception):
        d.n_users = 3  # frozen


@pytest.mark.parametrize("kwargs, field", [
    (dict(user=[0, 4], item=[0, 1], rating=[1.0, 2.0]), "user"),
    (dict(user=[0, -1], item=[0, 1], rating=[1.0, 2.0]), "user"),
    (dict(user=[0, 1], item=[0, 5], rating=[1.0, 2.0]), "item"),
    (dict(user=[0, 1], item=[0, 1], rating=[1.0, np.nan]), "rating"),
    (dict(user=[0, 1], item=[0, 1], rating=[np.inf, 1.0]), "rating"),
    (dict(user=[0, 1], item=[0, 1], rating=[1.0, 1e39]), "rating"),  # overflows float32
    (dict(user=[0, 1], item=[0, 1, 2], rating=[1.0, 2.0]), "lengths"),
    (dict(user=[0.0, 1.0], item=[0, 1], rating=[1.0, 2.0]), "user"),
    (dict(user=[0, 1], item=[0, 1], rating=[1.0, 2.0], timestamp=[1]), "timestamp"),
    (dict(user=[0, 1], item=[0, 1], rating=[1.0, 2.0], n_users=-1), "n_users"),
    (dict(user=[0, 1], item=[0, 1], rating=[1.0, 2.0], n_items=2.5), "n_items"),
])
def test_validation_errors_name_field(kwargs, field):
    kw = dict(n_users=4, n_items=5) | kwargs
    with pytest.raises(ValueError, match=field):
        Interactions(**kw)


def test_empty_is_allowed():
    d = Interactions(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), 3, 2)
    assert d.nnz == 0 and d.item_counts().tolist() == [0, 0]


def test_counts_subset_binarize():
    d = _small()
    assert d.item_counts().tolist() == [2, 1, 0, 2, 0] and d.item_counts().dtype == np.int64
    assert d.user_counts().tolist() == [2, 1, 2, 0]
    s = d.subset(np.array([4, 1]))
    assert s.user.tolist() == [2, 0] and s.rating.tolist() == [4.5, 3.0] and s.timestamp.tolist() == [50, 20]
    assert (s.n_users, s.n_items) == (4, 5)
    m = d.subset(d.user == 0)
    assert m.item.tolist() == [3, 0]
    with pytest.raises(ValueError, match="mask_or_index"):
        d.subset(np.array([True, False]))
    with pytest.raises(ValueError, match="mask_or_index"):
        d.subset(np.array([7]))
    b = d.binarize(4.0)
    assert b.user.tolist() == [2, 1, 2] and b.rating.tolist() == [1.0, 1.0, 1.0] and b.timestamp.tolist() == [10, 30, 50]


def test_to_csr_matches_dense_and_is_stable():
    rng = np.random.default_rng(0)
    n_users, n_items, nnz = 7, 6, 40
    d = Interactions(rng.integers(0, n_users, nnz), rng.integers(0, n_items, nnz),
                     rng.normal(size=nnz), n_users, n_items)
    for by, key, other, n in (("user", d.user, d.item, n_users), ("item", d.item, d.user, n_items)):
        indptr, indices, values, order = d.to_csr(by)
        assert indptr.dtype == np.int64 and indptr.shape == (n + 1,) and indptr[-1] == nnz
        assert indices.dtype == np.int32 and values.dtype == np.float32 and order.dtype == np.int64
        assert np.array_equal(indices, other[order]) and np.array_equal(values, d.rating[order])
        for r in range(n):
            rows = order[indptr[r]:indptr[r + 1]]
            assert np.all(key[rows] == r)
            assert np.all(np.diff(rows) > 0)  # stable: original order within the row
    with pytest.raises(ValueError, match="by"):
        d.to_csr("items")


def test_concat():
    d = _small()
    c = concat([d.subset(np.array([0, 1])), d.subset(np.array([2, 3, 4]))])
    assert np.array_equal(c.user, d.user) and np.array_equal(c.timestamp, d.timestamp)
    other = Interactions(d.user, d.item, d.rating, 5, 5)
    with pytest.raises(ValueError, match="n_users"):
        concat([d, other])
