"""jdp.altmin.users: each user's exact ridge solve from the release and the user's own ratings."""
import math

import numpy as np
import pytest

from jdp.altmin.users import UserSolver, solve_users
from jdp.data import Interactions


def _ratings():
    rng = np.random.default_rng(0)
    user = np.repeat(np.arange(6), 5).astype(np.int32)
    item = np.concatenate([rng.choice(8, 5, replace=False) for _ in range(6)]).astype(np.int32)
    return Interactions(user, item, rng.uniform(1, 5, user.size).astype(np.float32), 7, 8)


def test_rank_zero_user_bias_is_the_closed_form_ridge_mean():
    """No factors, no released biases: b_j = Σ_i (r_ij − μ) / (n_j + λ_b); a user without ratings gets 0."""
    data, mu, lam_b = _ratings(), 3.0, 5.0
    out = UserSolver(data, 1.0, lam_b)(np.zeros((8, 0), np.float32), np.zeros(8, np.float32), mu)
    n = np.bincount(data.user, minlength=7)
    want = np.bincount(data.user, weights=data.rating - mu, minlength=7) / (n + lam_b)
    np.testing.assert_allclose(out.bias, want, rtol=1e-5, atol=1e-6)
    assert out.factors.shape == (7, 0) and out.slope is None


def test_solve_users_matches_the_solver_and_factors_solve_the_normal_equations():
    data = _ratings()
    v = np.random.default_rng(1).normal(size=(8, 2)).astype(np.float32)
    out = solve_users(data, v, np.zeros(8, np.float32), 3.0, 0.5)
    rows = data.user == 2
    x, y = v[data.item[rows]], data.rating[rows] - 3.0
    np.testing.assert_allclose(out.factors[2], np.linalg.solve(x.T @ x + 0.5 * np.eye(2), x.T @ y), rtol=1e-4)
    np.testing.assert_allclose(out.bias, 0.0)


def test_slope_needs_a_bias_and_no_per_rating_ridge():
    with pytest.raises(ValueError, match="user_slope_reg"):
        UserSolver(_ratings(), 1.0, None, user_slope_reg=4.0)
    assert UserSolver(_ratings(), 1.0, 1.0, user_slope_reg=math.inf).slope_column is None
