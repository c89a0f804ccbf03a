"""Executes notebooks/dpformer.ipynb at tiny size (JDP_TINY=1)."""
import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dpformer_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "dpformer.ipynb", as_version=4)
    env_before = os.environ.get("JDP_TINY")
    os.environ["JDP_TINY"] = "1"
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("JDP_TINY", None)
        else:
            os.environ["JDP_TINY"] = env_before
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "total epsilon = 8.0000" in outputs
    assert "dpformer {" in outputs and "transformer {" in outputs
