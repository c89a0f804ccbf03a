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
