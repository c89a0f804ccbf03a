"""jdp.altmin.train: `fit` (the loop) and the zero-cost model; the package's import graph has no circle."""
import ast
import pathlib

import numpy as np
import pytest

import jdp.altmin
from jdp.altmin import AltMinConfig
from jdp.altmin.train import checked_config, fit, zero_cost_model
from jdp.data import Interactions, planted_powerlaw


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jdp.altmin"):
            found.add(node.module if node.module != "jdp.altmin" else f"jdp.altmin.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jdp.altmin.")}
    return found


def test_the_altmin_modules_import_each_other_without_a_circle():
    """config <- plan <- users/updates <- train <- tuning (and the package face above them): no module, at load or
    call time, imports one that imports it back."""
    folder = pathlib.Path(jdp.altmin.__file__).parent
    graph = {f"jdp.altmin.{p.stem}": _imports(p) for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state = {}

    def visit(m, path):
        assert state.get(m) != "open", f"import circle: {' -> '.join(path + [m])}"
        if state.get(m) is None:
            state[m] = "open"
            for d in graph[m]:
                visit(d, path + [m])
            state[m] = "done"
    for m in graph:
        visit(m, [])
    assert "jdp.altmin.tuning" not in graph["jdp.altmin.train"]


def test_fit_is_deterministic_with_a_seed_and_reports_what_it_planned():
    data = planted_powerlaw(seed=4, n_users=120, n_items=30, nnz=2000).data
    cfg = AltMinConfig(method="dpals-uniform", epsilon=1.0, show_progress=False)
    a, b = fit(data, cfg, seed=3), fit(data, cfg, seed=3)
    np.testing.assert_array_equal(a.item_bias, b.item_bias)
    assert a.seed == 3 and a.config.rating_range == (0.5, 5.0)
    assert a.report.epsilon() == pytest.approx(1.0, rel=1e-2)
    assert any("public rating scale (0.5, 5.0)" in s for s in a.report.assumptions)
    free = zero_cost_model(data, cfg)
    assert free.item_factors.shape == (30, 0) and not np.any(free.item_bias) and free.mean == 2.75


def test_checked_config_takes_the_data_scale_and_the_privacy_rule():
    data = Interactions(np.array([0, 1], np.int32), np.array([0, 1], np.int32), np.array([1.0, 2.0], np.float32),
                        10, 2, rating_range=(1.0, 5.0))
    assert checked_config(data, AltMinConfig()).rating_range == (1.0, 5.0)
    with pytest.raises(ValueError, match="1/n"):
        checked_config(data, AltMinConfig(delta=0.2))
    with pytest.raises(ValueError, match="no ratings"):
        fit(data.subset(data.user > 5), AltMinConfig(show_progress=False), seed=0)


def test_fit_with_tune_is_deprecated_and_still_refuses_an_unknown_tuner():
    data = planted_powerlaw(seed=4, n_users=120, n_items=30, nnz=2000).data
    with pytest.warns(DeprecationWarning, match="fit_tuned"), pytest.raises(ValueError, match="tune must be"):
        jdp.altmin.fit(data, AltMinConfig(show_progress=False), tune="validation")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="non-private reference"):
        jdp.altmin.fit(data, AltMinConfig(method="als", show_progress=False), tune="private")
