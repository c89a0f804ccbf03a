"""jdp.seqrec.transitions: the one-release item-to-item recommender (exact parts against naive computations)."""
import jax
import numpy as np
import pytest

from jdp.seqrec import data as D
from jdp.seqrec import transitions as T


def _naive_sum(seqs, candidates, n_items):
    K = len(candidates)
    out = np.zeros((K, K))
    where = {int(c): j for j, c in enumerate(candidates)}
    for s in seqs:
        m = np.zeros((K, K))
        for a, b in zip(s[:-1], s[1:]):
            if int(a) in where and int(b) in where:
                m[where[int(a)], where[int(b)]] += 1
        if m.any():
            out += m / np.sqrt((m ** 2).sum())
    return out


def test_sequences_and_sums_equal_a_naive_computation():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 9, size=n) for n in (1, 2, 5, 9, 12)] + [np.array([3, 3, 3, 3])]
    d = D.leave_last_out([s.copy() for s in seqs], 8, maxlen=20)
    got = T.user_sequences(d.train_input, d.train_target)
    # leave-last-out keeps all but the last two items in train (everything for users with < 3 items); the
    # training data are next-item pairs, so a one-item user has none
    want = [s[:0] if s.size == 1 else s if s.size < 3 else s[:-2] for s in seqs]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    cands = np.array([2, 3, 5, 8])
    np.testing.assert_allclose(T.transition_sum(want, cands, 8), _naive_sum(want, cands, 8), atol=1e-12)
    pres = T.normalized_presence(want, 8)
    naive = np.zeros(9)
    for s in want:
        u = np.unique(s)
        naive[u] += 1 / np.sqrt(u.size) if u.size else 0
    np.testing.assert_allclose(pres, naive)


def test_scores_rank_by_the_rows_of_the_recent_candidates():
    items = np.array([1, 2, 4])
    matrix = np.array([[0.0, 5.0, 1.0], [0.0, 0.0, 3.0], [2.0, 0.0, 0.0]])
    counts = np.array([0.0, 10.0, 20.0, 30.0, 5.0, 1.0])
    model = T.TransitionModel(items, matrix, counts, history=2, noise_multiplier=0.0, report=None)
    hist = np.array([[0, 3, 1], [0, 0, 5], [1, 2, 4]])
    sc = model.scores(hist)
    assert np.isneginf(sc[:, [0, 3, 5]]).all()              # padding and non-candidates rank last
    np.testing.assert_allclose(sc[0, items], matrix[0] + 1e-6 * counts[items] / 31.0)    # 3 is no candidate
    assert np.argmax(sc[1]) == 2                             # no candidate in the window: popularity of the release
    np.testing.assert_allclose(sc[2, items], matrix[1] + matrix[2] + 1e-6 * counts[items] / 31.0)
    # ranks: pessimistic ties, a target outside the candidates is never a hit
    m = model.evaluate(hist, np.array([2, 3, 4]), k=1)
    assert m == {"ndcg": pytest.approx(2 / 3), "hit": pytest.approx(2 / 3), "n_users": 3}


def test_non_private_fit_learns_the_planted_rule_and_the_private_one_beats_popularity():
    d = D.load("synthetic", data_seed=1)
    ref = T.fit(d, None, 1e-5, 100, jax.random.key(0))
    assert ref.report is None and ref.noise_multiplier == 0.0
    popular = T.TransitionModel(ref.items, np.zeros_like(ref.matrix), ref.counts, 3, 0.0, None)
    pop = popular.evaluate(d.valid_input, d.valid_target)["ndcg"]
    exact = ref.evaluate(d.valid_input, d.valid_target)["ndcg"]
    private = T.fit(d, 8.0, 1e-5, 100, jax.random.key(1))
    noisy = private.evaluate(d.valid_input, d.valid_target)["ndcg"]
    assert exact > 1.25 * pop and noisy > 1.25 * pop  # planted next-item rule: 0.59 / 0.58 vs 0.42
    assert private.report.epsilon() == pytest.approx(8.0, rel=1e-3)


@pytest.mark.parametrize("kwargs, match", [({"k": 0}, "k must be"), ({"k": 10**6}, "k must be"),
                                           ({"k": 5, "history": 0}, "history"), ({"k": 5, "epsilon": -1.0}, "epsilon"),
                                           ({"k": 5, "delta": 0.01}, "delta"),  # >= 1/n for 2,000 users
                                           ({"k": 5, "public_item_counts": np.ones(3)}, "public_item_counts")])
def test_invalid_arguments_are_refused(kwargs, match):
    d = D.load("synthetic", data_seed=1)
    args = {"epsilon": 1.0, "delta": 1e-5, "history": 3, "public_item_counts": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        T.fit(d, args["epsilon"], args["delta"], args["k"], jax.random.key(0), history=args["history"],
              public_item_counts=args["public_item_counts"])


def test_release_at_a_given_noise_reports_both_releases_and_fit_is_release_at_the_calibrated_noise():
    from jdp import accounting
    d = D.load("synthetic", data_seed=1)
    fitted = T.fit(d, 8.0, 1e-5, 40, jax.random.key(3))
    report = accounting.PrivacyReport(1e-5, unit="user", relation=accounting.ADD_OR_REMOVE_ONE)
    again = T.release(d, 40, jax.random.key(3), report, fitted.noise_multiplier)
    np.testing.assert_array_equal(again.items, fitted.items)
    np.testing.assert_array_equal(again.matrix, fitted.matrix)
    assert [(r.name, r.noise_scale) for r in report.releases] == [
        ("item popularity (per-user norm 1)", 4.0),
        ("item transition sums (per-user Frobenius norm 1)", fitted.noise_multiplier)]
    with pytest.raises(ValueError, match="noise_std"):
        T.release(d, 40, jax.random.key(3), report, 0.0)


def test_item_embedding_factorises_the_symmetrised_release_with_its_signs():
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(size=(7, 2)), rng.normal(size=(7, 2)) * 3.0
    sym = pos @ pos.T - neg @ neg.T                        # indefinite, rank 4: 2 positive, 2 negative eigenvalues
    skew = rng.normal(size=(7, 7))
    skew = skew - skew.T                                  # the antisymmetric part leaves the symmetrised matrix
    model = T.TransitionModel(np.arange(1, 8), sym + skew, np.ones(8), 3, 0.0, None)
    emb = T.item_embedding(model, 4)
    assert emb.rows.shape == (7, 4) and sorted(emb.signs) == [-1, -1, 1, 1]
    assert np.sqrt(np.mean(np.sum(emb.rows ** 2, axis=1))) == pytest.approx(1.0)   # a random embedding's RMS norm
    gram = emb.rows * emb.signs @ emb.rows.T
    np.testing.assert_allclose(gram / np.abs(gram).max(), sym / np.abs(sym).max(), rtol=1e-9, atol=1e-9)
    wide = T.item_embedding(model, 6)                     # rank 4: the other columns are 0 and unsigned
    assert not wide.rows[:, 4:].any() and not wide.signs[4:].any()
    np.testing.assert_allclose(wide.rows * wide.signs @ wide.rows.T, gram, atol=1e-9)
    top = T.item_embedding(model, 2)                      # the largest |eigenvalues|: here the negative ones
    assert list(top.signs) == [-1, -1]
    values = np.linalg.eigvalsh(sym)
    vals_top = np.sort(np.linalg.eigvalsh(top.rows * top.signs @ top.rows.T))
    np.testing.assert_allclose(vals_top[[0, 1]] / vals_top[0], np.sort(values)[:2] / np.sort(values)[0], rtol=1e-9)
    with pytest.raises(ValueError, match="d must be"):
        T.item_embedding(model, 0)

def test_default_k_is_the_public_rule_and_fit_uses_it_without_reading_the_data():
    # K = 2.5 sqrt(N / sigma): grows with the users and with epsilon (smaller sigma), within [1, n_items]
    assert T.default_k(31013, 0.646, 23715) == round(2.5 * (31013 / 0.646) ** 0.5) == 548
    assert T.default_k(943, 0.981, 1682) < T.default_k(943, 0.646, 1682) < T.default_k(31013, 0.646, 23715)
    assert T.default_k(10**9, 0.05, 300) == 300 and T.default_k(1, 500.0, 300) == 1
    with pytest.raises(ValueError, match="noise_std"):
        T.default_k(100, 0.0, 10)
    d = D.load("synthetic", data_seed=1)
    model = T.fit(d, 8.0, 1e-5, None, jax.random.key(3))
    assert model.items.size == T.default_k(d.n_users, model.noise_multiplier, d.n_items)
    # the same K from another data set of as many users: the rule reads no private value
    other = D.load("synthetic", data_seed=2)
    assert other.n_users == d.n_users and model.items.size < min(d.n_items, other.n_items)
    assert T.fit(other, 8.0, 1e-5, None, jax.random.key(3)).items.size == model.items.size
    with pytest.raises(ValueError, match="non-private"):
        T.fit(d, None, 1e-5, None, jax.random.key(3))
