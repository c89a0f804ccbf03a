import numpy as np
import pytest

from jdp.data import Interactions, fold_in_split, split_ratings


def _random(seed=0, n_users=300, n_items=80, nnz=6000):
    rng = np.random.default_rng(seed)
    codes = rng.choice(n_users * n_items, size=nnz, replace=False)
    return Interactions(codes // n_items, codes % n_items, rng.integers(1, 6, nnz).astype(np.float32),
                        n_users, n_items, timestamp=np.arange(nnz))


def _pairs(d, user_ids=None, item_ids=None):
    u = d.user if user_ids is None else user_ids[d.user]
    i = d.item if item_ids is None else item_ids[d.item]
    return set(zip(u.tolist(), i.tolist()))


@pytest.mark.parametrize("fractions", [(0.8, 0.1, 0.1), (0.8, 0.2)])
def test_split_ratings_sizes_disjoint_deterministic(fractions):
    d = _random()
    parts = split_ratings(d, fractions, seed=3)
    assert len(parts) == len(fractions)
    sizes = [p.nnz for p in parts]
    assert sum(sizes) == d.nnz
    for p, f in zip(parts[:-1], fractions[:-1]):
        assert p.nnz == int(np.floor(f * d.nnz))
    ts = np.concatenate([p.timestamp for p in parts])  # timestamps = original row index
    assert np.array_equal(np.sort(ts), np.arange(d.nnz))  # disjoint and covering
    for p in parts:
        assert np.all(np.diff(p.timestamp) > 0)  # original order kept within a part
        assert (p.n_users, p.n_items) == (d.n_users, d.n_items)
        assert np.array_equal(p.rating, d.rating[p.timestamp])
    again = split_ratings(d, fractions, seed=3)
    assert all(np.array_equal(a.timestamp, b.timestamp) for a, b in zip(parts, again))
    other = split_ratings(d, fractions, seed=4)
    assert not np.array_equal(parts[0].timestamp, other[0].timestamp)


@pytest.mark.parametrize("fractions", [(0.5, 0.6), (1.0,), (0.5, 0.2, 0.2, 0.1), (0.9, 0.0, 0.1), (0.5, np.nan, 0.5)])
def test_split_ratings_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions"):
        split_ratings(_random(), fractions)


def test_split_ratings_empty():
    empty = Interactions(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), 2, 2)
    with pytest.raises(ValueError, match="data"):
        split_ratings(empty)


def test_fold_in_protocol():
    d = _random(seed=1)
    # make a few users ineligible (< 5 items) to check the filter
    d = d.subset(~((d.user < 10) & (d.item > 2)))
    assert (d.user_counts()[:10] < 5).all()
    out = fold_in_split(d, n_heldout_users=40, min_items=5, history_frac=0.8, seed=7)
    tr, vh, vt, th, tt = (out[k] for k in ("train", "valid_history", "valid_target", "test_history", "test_target"))
    tu, vu, su, items = out["train_user_ids"], out["valid_user_ids"], out["test_user_ids"], out["item_ids"]
    # user groups: sizes, disjoint, only eligible users
    eligible = np.flatnonzero(d.user_counts() >= 5)
    assert vu.size == su.size == 40 and tu.size == eligible.size - 80
    assert np.array_equal(np.sort(np.concatenate([tu, vu, su])), eligible)
    assert (tr.n_users, vh.n_users, vt.n_users, th.n_users, tt.n_users) == (tu.size, 40, 40, 40, 40)
    # items: restricted to those seen in train, shared index across parts
    assert np.array_equal(items, np.unique(d.subset(np.isin(d.user, tu)).item))
    assert all(p.n_items == items.size for p in (tr, vh, vt, th, tt))
    # train = all observations of training users
    assert _pairs(tr, tu, items) == _pairs(d.subset(np.isin(d.user, tu)))
    for ids, hist, targ in ((vu, vh, vt), (su, th, tt)):
        full = d.subset(np.isin(d.user, ids) & np.isin(d.item, items))
        ph, pt = _pairs(hist, ids, items), _pairs(targ, ids, items)
        assert not (ph & pt) and (ph | pt) == _pairs(full)  # disjoint, covering (restricted items)
        n_u = np.bincount(hist.user, minlength=40) + np.bincount(targ.user, minlength=40)
        n_t = np.bincount(targ.user, minlength=40)
        expect = np.where(n_u >= 5, np.floor(0.2 * n_u + 1e-9), 0)
        assert np.array_equal(n_t, expect)
    # deterministic, and seed-dependent
    again = fold_in_split(d, 40, seed=7)
    assert np.array_equal(again["valid_user_ids"], vu) and _pairs(again["test_target"]) == _pairs(tt)
    other = fold_in_split(d, 40, seed=8)
    assert not np.array_equal(other["valid_user_ids"], vu)


def test_fold_in_keep_items_and_errors():
    d = _random(seed=2, n_users=50, n_items=400, nnz=1500)  # sparse: some items only seen by held-out users
    out = fold_in_split(d, 10, seed=0, restrict_items=False)
    assert out["train"].n_items == d.n_items and np.array_equal(out["item_ids"], np.arange(d.n_items))
    total = sum(out[k].nnz for k in ("train", "valid_history", "valid_target", "test_history", "test_target"))
    assert total == d.subset(d.user_counts()[d.user] >= 5).nnz
    restricted = fold_in_split(d, 10, seed=0)
    assert restricted["item_ids"].size < d.n_items
    with pytest.raises(ValueError, match="n_heldout_users"):
        fold_in_split(d, 25)
    with pytest.raises(ValueError, match="history_frac"):
        fold_in_split(d, 5, history_frac=1.0)
    with pytest.raises(ValueError, match="min_items"):
        fold_in_split(d, 5, min_items=0)


def test_fold_in_on_ml100k(datasets_dir):
    from jdp.data import load_ml100k
    d = load_ml100k(datasets_dir / "ml-100k").binarize(4.0)
    assert d.nnz == 55_375 and set(np.unique(d.rating).tolist()) == {1.0}  # ratings 4 and 5
    out = fold_in_split(d, n_heldout_users=100, seed=0)
    eligible = int((d.user_counts() >= 5).sum())
    assert out["train"].n_users == eligible - 200
    n_hist, n_targ = out["test_history"].user_counts(), out["test_target"].user_counts()
    assert (n_targ >= 1).all() and np.array_equal(n_targ, np.floor(0.2 * (n_hist + n_targ) + 1e-9))
    a, b = split_ratings(d, (0.8, 0.2), seed=0)
    assert (a.nnz, b.nnz) == (44_300, 11_075)


def _rows(d, users=None):
    """Multiset of (user, item, rating) rows, optionally restricted to `users`."""
    keep = np.ones(d.nnz, bool) if users is None else np.isin(d.user, users)
    return sorted(zip(d.user[keep].tolist(), d.item[keep].tolist(), d.rating[keep].tolist()))


def test_pair_hash_split_is_local_to_each_user():
    """Removing or adding one user (with all their rows) leaves every other user's train and valid rows
    unchanged; split_ratings, which permutes all rows together, does not (the old default of fit's tuning)."""
    from jdp.data import split_ratings_by_pair_hash
    d = _random(seed=5, n_users=200, n_items=80, nnz=6000)
    others = np.arange(1, d.n_users)
    without = d.subset(d.user != 0)
    for seed in (0, 11):
        full, neighbour = split_ratings_by_pair_hash(d, 0.1, seed=seed), split_ratings_by_pair_hash(without, 0.1, seed=seed)
        for a, b in zip(full, neighbour):
            assert _rows(a, others) == _rows(b, others) == _rows(b)
    # adding a brand-new heavy user: again nothing else moves
    extra = Interactions(np.concatenate([d.user, np.full(80, d.n_users)]), np.concatenate([d.item, np.arange(80)]),
                         np.concatenate([d.rating, np.full(80, 3.0, np.float32)]), d.n_users + 1, d.n_items)
    for a, b in zip(split_ratings_by_pair_hash(d), split_ratings_by_pair_hash(extra)):
        assert _rows(a) == _rows(b, np.arange(d.n_users))
    # the permutation split moves other users' rows: what this split exists to avoid
    moved = [_rows(a, others) != _rows(b, others)
             for a, b in zip(split_ratings(d, (0.9, 0.1), seed=0), split_ratings(without, (0.9, 0.1), seed=0))]
    assert all(moved)


def test_pair_hash_split_covers_every_row_and_validates():
    from jdp.data import split_ratings_by_pair_hash
    d = _random(seed=1, n_users=400, n_items=100, nnz=20_000)
    train, valid = split_ratings_by_pair_hash(d, 0.1, seed=3)
    ts = np.concatenate([train.timestamp, valid.timestamp])  # timestamps = original row index
    assert np.array_equal(np.sort(ts), np.arange(d.nnz))  # disjoint, covering: nothing dropped
    for p in (train, valid):
        assert np.all(np.diff(p.timestamp) > 0) and (p.n_users, p.n_items) == (d.n_users, d.n_items)
        assert np.array_equal(p.rating, d.rating[p.timestamp])
    assert abs(valid.nnz / d.nnz - 0.1) < 0.01  # ≈10%: binomial std 0.002
    # deterministic given the seed; another seed or fraction gives another split
    again = split_ratings_by_pair_hash(d, 0.1, seed=3)
    assert np.array_equal(again[1].timestamp, valid.timestamp)
    assert not np.array_equal(split_ratings_by_pair_hash(d, 0.1, seed=4)[1].timestamp, valid.timestamp)
    half = split_ratings_by_pair_hash(d, 0.5, seed=3)[1]
    assert abs(half.nnz / d.nnz - 0.5) < 0.02 and set(valid.timestamp) <= set(half.timestamp)  # nested thresholds
    # duplicate (user, item) rows land together
    dup = Interactions(np.r_[d.user, d.user[:50]], np.r_[d.item, d.item[:50]], np.r_[d.rating, d.rating[:50]],
                       d.n_users, d.n_items)
    tr, va = split_ratings_by_pair_hash(dup, 0.1, seed=3)
    assert len(set(zip(tr.user.tolist(), tr.item.tolist())) & set(zip(va.user.tolist(), va.item.tolist()))) == 0
    for bad in (0.0, 1.0, -0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="valid_fraction"):
            split_ratings_by_pair_hash(d, bad)
    for bad in (-1, 1.5, 2**64):
        with pytest.raises(ValueError, match="seed"):
            split_ratings_by_pair_hash(d, 0.1, seed=bad)
    with pytest.raises(ValueError, match="non-empty"):
        split_ratings_by_pair_hash(d.subset(np.zeros(d.nnz, bool)))
