"""Executes notebooks/private_selection.ipynb at tiny sizes (JDP_TINY=1)."""
import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_private_selection_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "private_selection.ipynb", as_version=4)
    saved = {k: os.environ.get(k) for k in ("JDP_TINY", "PYTHONPATH")}
    os.environ["JDP_TINY"] = "1"
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + (saved["PYTHONPATH"] or "")
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "selections/s" in outputs and "RNMH loss" in outputs
    assert "Error" not in outputs
