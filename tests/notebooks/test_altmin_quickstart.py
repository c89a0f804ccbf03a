import pytest

pytestmark = pytest.mark.slow  # CI runs it (make test-slow); the default suite stays under 10 minutes


def test_altmin_quickstart_notebook_runs(run_notebook):
    text, errors = run_notebook("altmin_quickstart.ipynb", timeout=600)
    assert not errors
    assert "ada-dpals" in text and "total epsilon = 1.0000" in text
