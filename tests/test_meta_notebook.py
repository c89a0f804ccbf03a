"""Executes notebooks/dp_meta_learning.ipynb at tiny size (JDP_TINY=1)."""
import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_meta_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "dp_meta_learning.ipynb", as_version=4)
    env_before = os.environ.get("JDP_TINY")
    os.environ["JDP_TINY"] = "1"
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("JDP_TINY")
        else:
            os.environ["JDP_TINY"] = env_before
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "transfer risk" in text and "PrivacyReport: unit=task" in text
