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


# ---------------------------------------------------------------------------------------------------
# The whole DP-FEST step as dp_sgd runs it: what one unit moves in what `accumulate` sums.
import flax.linen as nn  # noqa: E402
import optax  # noqa: E402

from jdp.clipping import dp_sgd  # noqa: E402
from jdp.clipping.sparse_rows import SparseRows, split_noise, step_noise_multiplier  # noqa: E402

GRAD_BOUND = 1.0 + 1e-5  # the engine's bound on one unit's clipped gradient, ÷ C (docs/privacy.md)


class _TiedNext(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(30, 8, name="item_embed")
        return embed.attend(nn.Dense(8, name="body")(embed(ids).sum(1)))


def _fest(ids_fn, C=1.0):
    model = _TiedNext()

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, batch["input"]), batch["target"])
    spec = SparseRows(("params", "item_embed", "embedding"), ids_fn)
    dp = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=100, batch_size=10, l2_clip=C, delta=1e-5, steps=1,
                noise_multiplier=1.0, sparse_rows=spec)
    return model, dp


def _unit_moves(dp, params, batch, unit):
    """(‖Δ clipped sum‖, ‖Δ counts‖) when `unit` leaves the chunk (its mask set to 0), in float64 from float32."""
    on = jnp.ones(batch["input"].shape[0], bool)
    (g1, c1), _ = dp.accumulate(params, dp.zeros(params), batch, on)
    (g0, c0), _ = dp.accumulate(params, dp.zeros(params), batch, on.at[unit].set(False))
    dg = np.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
                     for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))))
    dc = float(np.linalg.norm(np.asarray(c1, np.float64) - np.asarray(c0, np.float64)))
    return dg, dc


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 1e3, 1e6])
def test_one_crafted_unit_moves_the_dp_fest_step_within_its_combined_bound(scale):
    """Random restarts at extreme parameter scales with crafted ids (padding, -1, past the table, one repeated
    row, huge) and targets: each unit's move of the clipped sum stays ≤ C(1 + 1e-5), of the counts ≤ 1 + 2⁻²², so
    of the pair scaled by the step's two noises ≤ 1/σ (the one Gaussian the report accounts)."""
    model, dp = _fest(lambda b: jnp.concatenate([b["input"], b["target"][:, None]], 1), C=0.5)
    rng = np.random.default_rng(int(np.log10(scale)) + 10)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 5), jnp.int32))
    params = jax.tree.map(lambda x: x * scale, params)
    sigma_g, sigma_r = split_noise(dp.noise_multiplier, dp.sparse_rows.ratio)
    worst = 0.0
    for trial in range(6):
        ids = rng.integers(0, 30, size=(8, 5))
        ids[0] = [[-1, 29, -1, 29, 0], [0, 0, 0, 0, 0], [7, 7, 7, 7, 7], [30, 10**6, -10**6, 3, 3],
                  [1, 2, 3, 4, 5], [29, 28, 27, 26, 25]][trial]
        target = rng.integers(-2, 32, size=8)
        batch = {"input": jnp.asarray(ids, jnp.int32), "target": jnp.asarray(target, jnp.int32)}
        dg, dc = _unit_moves(dp, params, batch, 0)
        assert dg <= 0.5 * GRAD_BOUND and dc <= BOUND
        worst = max(worst, np.hypot(dg / (sigma_g * 0.5), dc / sigma_r) * step_noise_multiplier(sigma_g, sigma_r))
    assert worst <= GRAD_BOUND


def test_an_ids_function_that_reads_other_units_cannot_move_their_counts():
    """`ids` runs on each unit alone: a function that would hand unit b+1's rows to unit b (a roll over the batch)
    sees a batch of one, so removing a unit moves only its own counts, by at most 1."""
    model, dp = _fest(lambda b: jnp.roll(b["input"], 1, axis=0))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 5), jnp.int32))
    rng = np.random.default_rng(3)
    batch = {"input": jnp.asarray(rng.integers(1, 30, size=(8, 5)), jnp.int32),
             "target": jnp.asarray(rng.integers(1, 30, size=8), jnp.int32)}
    own = SparseRows(dp.sparse_rows.table, lambda b: b["input"])
    np.testing.assert_allclose(dp.sparse_rows.counts(params, batch, jnp.ones(8)), own.counts(params, batch, jnp.ones(8)))
    for unit in range(8):
        assert _unit_moves(dp, params, batch, unit)[1] <= BOUND
