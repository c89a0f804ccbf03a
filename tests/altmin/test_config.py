"""jdp.altmin.config: the method table and AltMinConfig (validated and completed once by `resolve`)."""
import dataclasses
import math

import numpy as np
import pytest

from jdp.altmin.config import ALLOCATIONS, DEFAULT_RATING_RANGE, METHODS, NOISY_GD, RIDGE, AltMinConfig, Method
from jdp.data import Interactions


def _ratings(rating_range=None):
    user, item = np.array([0, 0, 1, 2], np.int32), np.array([0, 1, 1, 2], np.int32)
    return Interactions(user, item, np.array([1.0, 3.0, 4.0, 5.0], np.float32), 3, 3, rating_range=rating_range)


def test_every_method_name_parses_to_one_rule_and_allocation():
    assert METHODS == ("als", "dpals-uniform", "dpals-tail", "ada-dpals", "dpsgd-uniform", "dpsgd-tail", "ada-dpsgd")
    for name in METHODS:
        m = Method.parse(name)
        assert m.rule in (RIDGE, NOISY_GD) and m.allocation in ALLOCATIONS
        assert m.private == (name != "als")
    assert Method.parse("dpsgd-tail") == Method(NOISY_GD, "tail")
    with pytest.raises(ValueError, match="method must be one of"):
        Method.parse("dpals")
    with pytest.raises(ValueError, match="exact ridge solve"):
        Method(NOISY_GD, "none")


def test_count_needs_follow_the_rule_and_allocation():
    needs = {m: (Method.parse(m).needs_counts, Method.parse(m).optional_counts) for m in METHODS}
    assert needs["als"] == (False, False) and needs["dpals-uniform"] == (False, False)
    assert needs["dpals-tail"] == (True, False) and needs["dpsgd-tail"] == (True, False)
    assert needs["ada-dpals"] == needs["ada-dpsgd"] == needs["dpsgd-uniform"] == (True, True)


def test_rating_range_none_means_the_datas_declared_scale_else_the_default():
    assert AltMinConfig().rating_range is None and AltMinConfig().scale == DEFAULT_RATING_RANGE
    assert AltMinConfig().for_data(_ratings((1.0, 5.0))).rating_range == (1.0, 5.0)
    assert AltMinConfig().for_data(_ratings()).rating_range == DEFAULT_RATING_RANGE
    assert AltMinConfig(rating_range=(0.5, 5.0)).for_data(_ratings((1.0, 5.0))).rating_range == (0.5, 5.0)
    assert AltMinConfig().resolve().rating_range == DEFAULT_RATING_RANGE  # a resolved config is concrete
    assert AltMinConfig(rating_range=(1, 10)).resolve().label_clip == 4.5


def test_resolve_fills_the_documented_defaults_and_is_idempotent():
    private = AltMinConfig(method="ada-dpals", epsilon=1.0).resolve()
    assert private.dim is None and private.steps == 2 and private.global_mean == "prior"
    assert private.bias_clip == private.user_clip and private.user_reg == 1.0 and private.user_bias_reg == 5.0
    assert private.user_slope_reg == private.label_clip ** 2 and private.reg_per_rating is False
    als = AltMinConfig(method="als", epsilon=3.0).resolve()
    assert als.epsilon is None and als.dim == 32 and als.steps == 10 and als.global_mean == "exact"
    assert als.reg_per_rating and als.user_slope_reg == math.inf and als.bias_clip == 1.0
    for cfg in (private, als, AltMinConfig(method="dpsgd-uniform", epsilon=20.0).resolve()):
        assert cfg.resolve() == cfg


@pytest.mark.parametrize("change,match", [
    ({"method": "nope"}, "method must be one of"), ({"rating_range": (5.0, 1.0)}, "rating_range"),
    ({"epsilon": -1.0}, "epsilon"), ({"budget": 0}, "budget"), ({"count_fraction": 1.0}, "count_fraction"),
    ({"weight_mode": "x"}, "weight_mode"), ({"item_bias_mean": "x"}, "item_bias_mean"),
    ({"count_release": True, "method": "dpals-uniform"}, "count_release"),
    ({"label_norm": 1.0, "method": "ada-dpsgd"}, "label_norm"), ({"global_mean": "exact"}, "global_mean='exact'"),
    ({"global_mean": 9.0}, "global_mean"), ({"ratings_per_user": 1e3}, "ratings_per_user"),
    ({"user_slope_reg": -1.0}, "user_slope_reg"), ({"dim": -1}, "dim must be"),
])
def test_resolve_refuses_invalid_fields_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(AltMinConfig(method="ada-dpals", epsilon=1.0), **change).resolve()


def test_feature_and_label_bounds_of_a_resolved_config():
    cfg = dataclasses.replace(AltMinConfig(method="ada-dpals", epsilon=1.0).resolve(), dim=4)
    assert cfg.item_feature_bound == pytest.approx(math.hypot(cfg.user_clip, cfg.bias_clip))
    assert dataclasses.replace(cfg, dim=0).item_feature_bound == cfg.bias_clip
    assert dataclasses.replace(cfg, biases=False).item_feature_bound == cfg.user_clip
    ssp0 = dataclasses.replace(AltMinConfig(method="ada-dpals", epsilon=1.0, dim=0).resolve())
    assert ssp0.label_norm == pytest.approx(0.5 * math.sqrt(ssp0.budget) * ssp0.label_clip)
    assert ssp0.label_bound == pytest.approx(min(ssp0.label_clip, ssp0.label_norm / math.sqrt(ssp0.budget)))
