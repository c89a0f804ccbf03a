"""jdp.seqrec.transitions against its worst neighbours: one user moves each released sum by at most 1 (L2), the
noise drawn is the noise reported, and the report composes to the ε asked for."""
import jax
import numpy as np
import pytest

from jdp.seqrec import data as D
from jdp.seqrec import transitions as T

N_ITEMS = 30
CANDIDATES = np.array([1, 2, 3, 5, 8, 13, 21])
WORST_USERS = [
    np.array([1, 2] * 26),                       # one transition repeated 51 times (the longest window)
    np.array([1, 2, 3, 5, 8, 13, 21, 1, 3, 8, 21, 2, 5, 13]),   # many distinct candidate transitions
    np.array([1, 1, 1, 1]),                      # a self-loop
    np.array([4, 6, 7, 9, 10]),                  # no candidate at all
    np.array([2]),                               # a single item
    np.arange(1, N_ITEMS + 1),                   # every item once
]


def _base():
    rng = np.random.default_rng(0)
    return [rng.integers(1, N_ITEMS + 1, size=rng.integers(2, 20)) for _ in range(40)]


@pytest.mark.parametrize("user", WORST_USERS, ids=range(len(WORST_USERS)))
def test_one_user_moves_each_released_sum_by_at_most_one(user):
    base = _base()
    with_user = base + [user]
    d_matrix = T.transition_sum(with_user, CANDIDATES, N_ITEMS) - T.transition_sum(base, CANDIDATES, N_ITEMS)
    d_pop = T.normalized_presence(with_user, N_ITEMS) - T.normalized_presence(base, N_ITEMS)
    has_transition = any(a in CANDIDATES and b in CANDIDATES for a, b in zip(user[:-1], user[1:]))
    assert np.linalg.norm(d_matrix) == pytest.approx(1.0 if has_transition else 0.0, abs=1e-12)
    assert np.linalg.norm(d_pop) == pytest.approx(1.0, abs=1e-12)   # every user with an item: exactly 1


def test_the_noise_drawn_is_the_noise_reported_and_the_report_meets_epsilon():
    d = D.load("synthetic", data_seed=0)
    k, eps = 200, 3.0
    model = T.fit(d, eps, 1e-5, k, jax.random.key(3))
    rows = {r.name: r for r in model.report.releases}
    assert set(rows) == {"item popularity (per-user norm 1)", "item transition sums (per-user Frobenius norm 1)"}
    assert all(r.sensitivity == 1.0 for r in rows.values())
    assert rows["item transition sums (per-user Frobenius norm 1)"].noise_scale == pytest.approx(model.noise_multiplier)
    assert model.report.epsilon() == pytest.approx(eps, rel=1e-3)
    seqs = T.user_sequences(d.train_input, d.train_target)
    residual = model.matrix - T.transition_sum(seqs, model.items, d.n_items)
    assert residual.dtype == np.float64                                  # released in float64
    assert np.std(residual) == pytest.approx(model.noise_multiplier, rel=0.03)   # 40,000 draws
    pop_residual = model.counts[1:] - T.normalized_presence(seqs, d.n_items)[1:]
    assert np.std(pop_residual) == pytest.approx(4.0, rel=0.15)          # the default histogram noise (499 items)
    assert model.counts[0] == 0.0


def test_declared_public_counts_replace_the_histogram_release():
    d = D.load("synthetic", data_seed=0)
    public = np.arange(d.n_items + 1, dtype=float)
    model = T.fit(d, 3.0, 1e-5, 50, jax.random.key(0), public_item_counts=public)
    assert [r.name for r in model.report.releases] == ["item transition sums (per-user Frobenius norm 1)"]
    assert any("declared public" in a for a in model.report.assumptions)
    assert np.array_equal(model.items, np.arange(d.n_items - 49, d.n_items + 1))   # the 50 largest public counts
    with pytest.raises(ValueError, match="public_item_counts"):
        T.fit(d, 3.0, 1e-5, 50, jax.random.key(0), public_item_counts=public[:-1])
