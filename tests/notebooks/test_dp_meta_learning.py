"""Executes notebooks/dp_meta_learning.ipynb at tiny size (JDP_TINY=1)."""

import pytest

pytestmark = pytest.mark.slow  # CI runs it (make test-slow); the default suite stays under 10 minutes


def test_meta_notebook_runs(run_notebook):
    text, errors = run_notebook("dp_meta_learning.ipynb", timeout=300)
    assert not errors
    assert "transfer risk" in text and "PrivacyReport: unit=task" in text
