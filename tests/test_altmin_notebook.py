import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_altmin_quickstart_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "altmin_quickstart.ipynb", as_version=4)
    env_before = os.environ.get("JDP_TINY")
    os.environ["JDP_TINY"] = "1"
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("JDP_TINY", None)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "ada-dpals" in outputs and "total epsilon = 1.0000" in outputs
