"""Executes the notebooks in place at full size and saves their outputs (what a reader sees on GitHub / Colab).

    PYTHONPATH=. python notebooks/execute.py [name.ipynb ...]      # default: every notebook here

Data comes through `jdp.data.fetch` (set $JDP_DATA to a cache that already holds the files to run offline).
Outputs are kept small: the repository root and the data cache are written as relative / `$JDP_DATA` paths, and
widget outputs (tqdm's notebook progress bars) and the widget state are dropped: saved, they show a bar frozen at
its first frame (or "Loading widget...") on GitHub and Colab.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _scrub(text: str) -> str:
    """Machine paths out of saved outputs: the repository root and the data cache."""
    text = text.replace(str(ROOT) + os.sep, "")
    cache = os.environ.get("JDP_DATA")
    return text.replace(cache, "$JDP_DATA") if cache else text


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def strip_widgets(nb) -> None:
    """Drops widget outputs and the notebook's saved widget state (in place)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.get("outputs", []) if WIDGET_VIEW not in o.get("data", {})]


def execute(path: pathlib.Path, timeout: int = 3600) -> float:
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = _scrub(out["text"])
            for key in ("text/plain", "text/html"):
                if key in out.get("data", {}):
                    out["data"][key] = _scrub(out["data"][key])
    strip_widgets(nb)
    nbformat.write(nb, path)
    return time.perf_counter() - t0


def main(names: list[str]) -> None:
    os.environ.pop("JDP_TINY", None)
    paths = [HERE / n for n in names] if names else sorted(HERE.glob("*.ipynb"))
    for p in paths:
        print(f"{p.name}: {execute(p):.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
