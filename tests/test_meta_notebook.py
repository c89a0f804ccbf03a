"""Executes notebooks/dp_meta_learning.ipynb at tiny size (JDP_TINY=1)."""


def test_meta_notebook_runs(run_notebook):
    text, errors = run_notebook("dp_meta_learning.ipynb", timeout=300)
    assert not errors
    assert "transfer risk" in text and "PrivacyReport: unit=task" in text
