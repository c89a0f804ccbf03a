"""DP-FEST's contribution counts (`jdp.clipping.sparse_rows.row_counts`): one unit moves the summed counts by at most
1 (+ float32 rounding of its own entries, 2⁻²²) in L2, for every input an attacker can craft: repeated ids,
negative ids (which a scatter would wrap onto the last rows), ids past the table, the padding id, NaN / huge / negative
weights, one row or every row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.clipping.sparse_rows import row_counts

BOUND = 1.0 + 2.0 ** -22
_counts = jax.jit(row_counts, static_argnums=(2,))  # one program per shape (the search keeps shapes fixed)


def _contribution(ids, weights, unit, n_rows):
    """L2 change of the summed counts when `unit` is removed (its weight set to 0), as computed in float32."""
    with_unit = _counts(jnp.asarray(ids), jnp.asarray(weights, jnp.float32), n_rows)
    w = np.array(weights, np.float32)
    w[unit] = 0.0
    without = _counts(jnp.asarray(ids), jnp.asarray(w), n_rows)
    return float(np.linalg.norm(np.asarray(with_unit, np.float64) - np.asarray(without, np.float64)))


@pytest.mark.parametrize("crafted", [
    [-1, 49, -1, 49, 0, 0],          # -1 wraps to the last row in a plain scatter: two "distinct" ids, one row
    [-50, 0, -49, 1, 2, 3],          # negative ids aliasing rows 0..3
    [50, 51, 10**6, -10**6, 7, 7],   # past the table, huge, repeated
    [7, 7, 7, 7, 7, 7],              # one row, repeated
    [0, 0, 0, 0, 0, 0],              # padding only: no contribution
    list(range(1, 7)),               # six distinct rows
])
@pytest.mark.parametrize("weight", [1.0, 2.0, 1e30, -1.0, float("nan"), float("inf")])
def test_one_crafted_unit_moves_the_counts_by_at_most_one(crafted, weight):
    rng = np.random.default_rng(0)
    n_rows = 50
    ids = rng.integers(0, n_rows, size=(16, 6))
    ids[5] = crafted
    weights = np.ones(16, np.float32)
    weights[5] = weight
    assert _contribution(ids, weights, 5, n_rows) <= BOUND


def test_the_wrapping_attack_breaks_a_plain_scatter():
    """What the valid-id mask prevents: deduplicating by value and scattering with numpy/JAX index rules sends -1
    and 49 (two distinct values) onto one row of a 50-row table: 2/sqrt(2) = 1.41 from one unit."""
    unit = np.array([-1, 49, 0, 0])
    distinct = [i for i in set(unit.tolist()) if i != 0]
    plain = jnp.zeros(50).at[jnp.asarray(distinct)].add(1.0 / np.sqrt(len(distinct)))
    assert float(jnp.linalg.norm(plain)) > 1.4
    assert float(jnp.linalg.norm(row_counts(jnp.asarray(unit[None]), jnp.ones(1), 50))) <= BOUND


def test_random_search_over_crafted_units_finds_no_contribution_above_one():
    """A search over 300 random units mixing valid, padding, negative and out-of-range ids at many lengths (each
    unit's T ids, then padding to 40 positions: one compiled shape)."""
    rng = np.random.default_rng(1)
    n_rows, worst = 64, 0.0
    for trial in range(300):
        T = int(rng.integers(1, 40))
        pool = np.concatenate([rng.integers(-n_rows, 2 * n_rows, size=T), rng.integers(0, 3, size=T)])
        ids = np.zeros((8, 40), np.int64)
        ids[:, :T] = rng.integers(0, n_rows, size=(8, T))
        ids[trial % 8, :T] = rng.choice(pool, size=T)
        worst = max(worst, _contribution(ids, np.ones(8, np.float32), trial % 8, n_rows))
    assert 0.99 < worst <= BOUND  # a unit with rows reaches norm 1 (the bound is tight), never above


def test_counts_are_jit_compatible_and_match_eagerly():
    ids = jnp.array([[1, 2, 2, -1], [3, 0, 0, 0]])
    eager = row_counts(ids, jnp.ones(2), 5)
    np.testing.assert_array_equal(np.asarray(jax.jit(row_counts, static_argnums=(2,))(ids, jnp.ones(2), 5)),
                                  np.asarray(eager))
    np.testing.assert_allclose(np.asarray(eager), [0, 2 ** -0.5, 2 ** -0.5, 1.0, 0], rtol=1e-7)
