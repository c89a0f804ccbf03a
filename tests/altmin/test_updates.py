"""jdp.altmin.updates: budget allocation and the item update classes, one per rule, picked from ITEM_UPDATES."""
import jax
import numpy as np
import pytest

from jdp.altmin.config import METHODS, AltMinConfig, Method
from jdp.altmin.plan import plan_run
from jdp.altmin.updates import ITEM_UPDATES, allocation_weights, item_update_features
from jdp.data import planted_powerlaw


def test_every_rule_of_the_method_table_has_one_item_update_class():
    assert {Method.parse(m).rule for m in METHODS} == set(ITEM_UPDATES)
    for cls in ITEM_UPDATES.values():
        assert callable(cls.__call__)


@pytest.mark.parametrize("method", ["als", "dpals-uniform", "dpals-tail", "ada-dpals"])
def test_allocations_keep_every_users_squared_weights_within_the_budget(method):
    data = planted_powerlaw(seed=2, n_users=60, n_items=30, nnz=1500).data
    cfg = AltMinConfig(method=method, epsilon=None if method == "als" else 5.0, budget=8, count_release=None)
    plan = plan_run(cfg, data.n_users, data.n_items)
    weights, counts = allocation_weights(data, plan.config, plan.noise, jax.random.key(0), jax.random.key(1))
    per_user = np.bincount(data.user, weights=np.asarray(weights, np.float64) ** 2, minlength=data.n_users)
    if method == "als":
        np.testing.assert_array_equal(weights, 1.0)
        assert counts is None
    else:
        assert per_user.max() <= 8 * (1 + 1e-5)
    assert (counts is not None) == plan.config.releases_counts


def test_item_update_features_are_within_the_feature_bound():
    cfg = plan_run(AltMinConfig(method="ada-dpals", epsilon=1.0, dim=3), 100, 10).config
    u = np.random.default_rng(0).normal(0, 5, (50, 3)).astype(np.float32)
    feats = np.asarray(item_update_features(u, cfg))
    assert feats.shape == (50, 4) and np.all(feats[:, -1] == cfg.bias_clip)
    assert np.linalg.norm(feats, axis=1).max() <= cfg.item_feature_bound * (1 + 1e-6)
