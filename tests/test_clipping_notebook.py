"""Executes notebooks/dp_sgd_flax.ipynb at tiny sizes (JDP_TINY=1)."""
import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dp_sgd_flax_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "dp_sgd_flax.ipynb", as_version=4)
    env_backup = dict(os.environ)
    os.environ["JDP_TINY"] = "1"
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "max rel. difference to vmap(grad)" in outputs
    assert "total epsilon" in outputs
    assert "one manual step done" in outputs
