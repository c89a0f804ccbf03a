"""Executes notebooks/dpformer.ipynb at tiny size (JDP_TINY=1)."""

import pytest

pytestmark = pytest.mark.slow  # CI runs it (make test-slow); the default suite stays under 10 minutes


def test_dpformer_notebook_runs(run_notebook):
    text, errors = run_notebook("dpformer.ipynb", timeout=300)
    assert not errors
    assert "total epsilon = 8.0000" in text
    assert "dpformer {" in text and "transformer {" in text
