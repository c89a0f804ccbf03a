"""Executes notebooks/dp_sgd_flax.ipynb at tiny sizes (JDP_TINY=1)."""

import pytest

pytestmark = pytest.mark.slow  # CI runs it (make test-slow); the default suite stays under 10 minutes


def test_dp_sgd_flax_notebook_runs(run_notebook):
    text, errors = run_notebook("dp_sgd_flax.ipynb", timeout=300)
    assert not errors
    assert "max rel. difference to vmap(grad)" in text
    assert "total epsilon" in text
    assert "one manual step done" in text
    assert "nnx DP-SGD done" in text and "'conv'" in text
