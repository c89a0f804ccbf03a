"""jdp.altmin.tuning: the private tuning entry point `fit_tuned` and its public grid."""
import dataclasses

import numpy as np
import pytest

from jdp.altmin import AltMinConfig
from jdp.altmin import tuning
from jdp.altmin.tuning import fit_tuned, public_grid
from jdp.data import Interactions, planted_powerlaw


def test_public_grid_is_fixed_around_the_config():
    cfg = AltMinConfig(method="ada-dpals", epsilon=1.0, budget=10, reg_scale=2.0)
    grid = public_grid(cfg)
    assert grid[0] == cfg and [g.reg_scale for g in grid[1:3]] == [1.0, 8.0] and [g.budget for g in grid[3:]] == [5, 20]


def test_fit_tuned_refuses_the_reference_and_an_invalid_config_before_any_work(monkeypatch):
    data = Interactions(np.array([0, 1], np.int32), np.array([0, 1], np.int32), np.array([1.0, 2.0], np.float32), 10, 2)
    monkeypatch.setattr(tuning, "tune_private", lambda *a, **k: pytest.fail("tuned before validating"))
    with pytest.raises(ValueError, match="non-private reference"):
        fit_tuned(data, AltMinConfig(method="als"))
    with pytest.raises(ValueError, match="1/n"):
        fit_tuned(data, AltMinConfig(epsilon=1.0, delta=0.5))


def test_fit_tuned_hands_the_data_scale_and_a_pair_hash_split_to_tune_private(monkeypatch):
    seen = {}

    def capture(train, valid, configs, **kwargs):
        seen.update(train=train, valid=valid, configs=configs, **kwargs)
        raise RuntimeError("captured")

    monkeypatch.setattr(tuning, "tune_private", capture)
    data = dataclasses.replace(planted_powerlaw(seed=0, n_users=100, n_items=20, nnz=1500).data, rating_range=(0.0, 10.0))
    with pytest.raises(RuntimeError, match="captured"):
        fit_tuned(data, AltMinConfig(method="ada-dpals", epsilon=2.0), seed=4)
    assert seen["train"].nnz + seen["valid"].nnz == data.nnz and seen["epsilon"] == 2.0 and seen["seed"] == 4
    assert {c.rating_range for c in seen["configs"]} == {(0.0, 10.0)} and len(seen["configs"]) == 5
