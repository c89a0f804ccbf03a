import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event as dpe

from jdp.accounting import compute_epsilon, gaussian_event
from jdp.clipping import sparse_rows as S


def _naive_counts(ids, weights, n_rows, pad_id=0):
    out = np.zeros(n_rows)
    for row, w in zip(np.asarray(ids), np.asarray(weights)):
        rows = {int(i) for i in row if 0 <= i < n_rows and i != pad_id}
        for r in rows:
            out[r] += min(max(w, 0.0), 1.0) / np.sqrt(len(rows))
    return out


def test_row_counts_equal_a_naive_computation():
    rng = np.random.default_rng(0)
    ids = rng.integers(-3, 14, size=(9, 7))
    ids[2] = 0                      # only padding: no rows
    ids[3] = 5                      # one row, repeated
    weights = np.array([1, 1, 1, 1, 0, 1, 1, 0, 1], np.float32)
    got = S.row_counts(jnp.asarray(ids), jnp.asarray(weights), 12)
    np.testing.assert_allclose(np.asarray(got), _naive_counts(ids, weights, 12), rtol=1e-6, atol=1e-7)
    no_pad = S.row_counts(jnp.asarray(ids), jnp.asarray(weights), 12, pad_id=None)
    np.testing.assert_allclose(np.asarray(no_pad), _naive_counts(ids, weights, 12, pad_id=-99), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="integer"):
        S.row_counts(jnp.zeros((2, 3)), jnp.ones(2), 4)
    with pytest.raises(ValueError, match="n_rows"):
        S.row_counts(jnp.asarray(ids), jnp.ones(9), 0)


def test_selection_keeps_rows_above_the_threshold_and_noise_lands_on_them_only():
    counts = jnp.array([0.0, 50.0, 0.2, 30.0, 0.0])
    keep = S.select_rows(jax.random.PRNGKey(0), counts, noise_std=1.0, threshold=10.0)
    assert keep.tolist() == [False, True, False, True, False]
    g = jnp.arange(10.0).reshape(5, 2)
    noisy = S.noisy_selected_rows(jax.random.PRNGKey(1), g, keep, noise_std=0.5)
    assert np.all(np.asarray(noisy)[[0, 2, 4]] == 0.0)
    assert np.all(np.asarray(noisy)[[1, 3]] != np.asarray(g)[[1, 3]])
    with pytest.raises(ValueError, match="threshold"):
        S.select_rows(jax.random.PRNGKey(0), counts, 1.0, float("nan"))
    with pytest.raises(ValueError, match="noise_std"):
        S.noisy_selected_rows(jax.random.PRNGKey(1), g, keep, 0.0)


def test_the_step_is_one_gaussian_of_the_combined_noise_multiplier():
    sg, sr = 1.1, 3.0
    eff = S.step_noise_multiplier(sg, sr)
    assert eff == pytest.approx((sg ** -2 + sr ** -2) ** -0.5)
    # without sampling, the two Gaussians on one input compose to exactly that Gaussian (RDP is additive in 1/σ²)
    both = compute_epsilon(dpe.ComposedDpEvent([gaussian_event(sg), gaussian_event(sr)]), 1e-5)
    assert compute_epsilon(gaussian_event(eff), 1e-5) == pytest.approx(both, rel=1e-9)
    event = S.step_event(0.01, sg, sr, steps=100)
    assert event == dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.01, dpe.GaussianDpEvent(eff)), 100)
    assert compute_epsilon(event, 1e-5) > compute_epsilon(S.step_event(0.01, sg, 1e6, steps=100), 1e-5)
    with pytest.raises(ValueError, match="sampling_rate"):
        S.step_event(1.5, sg, sr)


# ---------------------------------------------------------------------------------------------------
# Wired into dp_sgd.
import flax.linen as nn  # noqa: E402
import optax  # noqa: E402

from jdp.clipping import dp_sgd  # noqa: E402
from jdp.clipping.dp_sgd import DP_FEST_RELEASE, with_noise_key, without_noise_key  # noqa: E402


class _Tied(nn.Module):
    """A tiny next-item model with a tied table (input lookup and output `attend`)."""
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(20, 4, name="item_embed")
        h = nn.Dense(4, name="body")(embed(ids).mean(1))
        return embed.attend(h)


def _tied_problem(n=64):
    model = _Tied()
    rng = np.random.default_rng(0)
    data = {"input": jnp.asarray(rng.integers(0, 8, size=(n, 3))), "target": jnp.asarray(rng.integers(1, 8, size=n))}
    params = model.init(jax.random.PRNGKey(0), data["input"][:1])

    def loss_fn(p, batch):
        logits = model.apply(p, batch["input"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["target"])
    spec = S.SparseRows(table=("params", "item_embed", "embedding"),
                        ids=lambda b: jnp.concatenate([b["input"], b["target"][:, None]], 1))
    return params, data, loss_fn, spec


def test_split_noise_keeps_the_steps_one_gaussian():
    g, r = S.split_noise(0.9, 2.0)
    assert r == pytest.approx(2 * g)
    assert S.step_noise_multiplier(g, r) == pytest.approx(0.9, rel=1e-12)


def test_dp_fest_in_dp_sgd_updates_only_rows_that_units_touch_and_reports_the_same_epsilon():
    params, data, loss_fn, spec = _tied_problem()
    kw = dict(num_examples=64, batch_size=32, l2_clip=1.0, delta=1e-5, steps=5, noise_multiplier=1.0)
    plain = dp_sgd(loss_fn, optax.sgd(0.1), **kw)
    fest = dp_sgd(loss_fn, optax.sgd(0.1), sparse_rows=S.SparseRows(spec.table, spec.ids, threshold=2.0), **kw)
    assert fest.epsilon() == pytest.approx(plain.epsilon(), rel=1e-12)
    assert fest.report().releases[0].name == DP_FEST_RELEASE
    new, _, _ = fest.fit(params, data, jax.random.PRNGKey(1), progress=False)
    moved = np.any(np.asarray(new["params"]["item_embed"]["embedding"])
                   != np.asarray(params["params"]["item_embed"]["embedding"]), axis=1)
    # ids 0..7 are touched (0 is padding: never counted); rows 8..19 are no unit's: selected only by noise over
    # 2 σ_r (probability 2.3% each per step), and every other parameter moves
    assert moved[1:8].all() and moved[8:].sum() <= 4 and not moved[0]
    assert not np.allclose(new["params"]["body"]["kernel"], params["params"]["body"]["kernel"])


def test_dp_fest_accumulates_counts_beside_the_sum_and_refuses_a_missing_table():
    params, data, loss_fn, spec = _tied_problem()
    fest = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=64, batch_size=32, l2_clip=1.0, delta=1e-5, steps=2,
                  noise_multiplier=1.0, sparse_rows=spec)
    batch = jax.tree.map(lambda x: x[:16], data)
    mask = jnp.ones(16, bool).at[3].set(False)
    (g, counts), sums = fest.accumulate(params, fest.zeros(params), batch, mask)
    np.testing.assert_allclose(np.asarray(counts), S.row_counts(spec.ids(batch), mask, 20), rtol=1e-6)
    assert int(sums["count"]) == 15 and jax.tree.structure(g) == jax.tree.structure(params)
    state = fest.init(params, jax.random.PRNGKey(2))
    after = fest.apply(state, (g, counts))
    assert int(after.step) == 1
    # the noise key is zeroed for checkpoints and restored as for plain DP-SGD
    bare = without_noise_key(after.opt_state)
    assert all(not np.any(np.asarray(k)) for k in jax.tree.leaves(bare[0].key))
    restored = with_noise_key(bare, jax.random.PRNGKey(2))
    np.testing.assert_array_equal(restored[0].key, after.opt_state[0].key)
    missing = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=64, batch_size=32, l2_clip=1.0, delta=1e-5, steps=2,
                     noise_multiplier=1.0, sparse_rows=S.SparseRows(("params", "nope"), spec.ids))
    with pytest.raises(ValueError, match="no embedding table"):
        missing.init(params, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="tuple of names"):
        S.SparseRows("params/item_embed/embedding", spec.ids)
    with pytest.raises(ValueError, match="SparseRows"):
        dp_sgd(loss_fn, optax.sgd(0.1), num_examples=64, batch_size=32, l2_clip=1.0, delta=1e-5, steps=2,
               noise_multiplier=1.0, sparse_rows={"table": spec.table})
