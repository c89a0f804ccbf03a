"""Executes notebooks/private_selection.ipynb at tiny sizes (JDP_TINY=1)."""

import pytest

pytestmark = pytest.mark.slow  # CI runs it (make test-slow); the default suite stays under 10 minutes


def test_private_selection_notebook_runs(run_notebook):
    text, errors = run_notebook("private_selection.ipynb", timeout=120)
    assert not errors
    assert "selections/s" in text and "RNMH loss" in text
    assert "Error" not in text
