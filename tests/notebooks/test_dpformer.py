"""Executes notebooks/dpformer.ipynb at tiny size (JDP_TINY=1)."""

import pytest

pytestmark = pytest.mark.slow  # CI runs it (make test-slow); the default suite stays under 10 minutes


def test_dpformer_notebook_runs(run_notebook):
    text, errors = run_notebook("dpformer.ipynb", timeout=300)
    assert not errors
    assert "total epsilon = 8.0000" in text
    assert "dpformer {" in text and "transformer {" in text
    # the private models beside what users get for free, in a table and a plot
    rows = {line.split("  ")[0].split(" (")[0]: line.split()[-2:] for line in text.splitlines()
            if line.startswith(("DPFormer (", "Transformer (", "popularity baseline", "zero-cost baseline"))}
    assert set(rows) == {"DPFormer", "Transformer", "popularity baseline", "zero-cost baseline"}, text
    assert all(0.0 <= float(v) <= 1.0 for pair in rows.values() for v in pair), rows
    outputs = [o for c in run_notebook.last.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the baseline plot"
