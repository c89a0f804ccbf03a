"""Every package guide in docs/ has the same sections, and its minimal example runs as written.

The example is the first ```python block under `## Minimal example`; it runs in a fresh namespace
(examples assert their own privacy claims, e.g. the report's ε). Examples whose compilation takes
most of a minute are marked slow (run with `-m slow`)."""
from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
SECTIONS = ["What it does", "Unit of privacy and neighbouring relation", "Minimal example", "API",
            "Performance", "Limits"]
GUIDES = ["accounting", "altmin", "clipping", "data", "meta", "multitask", "selection", "seqrec"]
SLOW = {"altmin", "meta", "seqrec"}  # each compiles a whole private fit: ~30-45 s on 2 shared cores


def sections(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^## (.+)$", text, flags=re.M)]


def minimal_example(text: str) -> str:
    part = text.split("\n## Minimal example\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", part, flags=re.S)
    assert m, "no ```python block under '## Minimal example'"
    return m.group(1)


@pytest.mark.parametrize("name", GUIDES)
def test_guide_has_the_common_sections_in_order(name):
    got = sections((DOCS / f"{name}.md").read_text())
    assert got[:len(SECTIONS)] == SECTIONS, got
    assert "privacy.md" in (DOCS / f"{name}.md").read_text().split("## Minimal example")[0], \
        "the privacy section links the cross-package index docs/privacy.md"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in GUIDES])
def test_minimal_example_runs(name, capsys):
    code = minimal_example((DOCS / f"{name}.md").read_text())
    exec(compile(code, f"docs/{name}.md", "exec"), {"__name__": f"docs_{name}"})
    assert capsys.readouterr().out.strip(), "the example prints what it computed"


def test_every_notebook_opens_with_the_same_guarded_install_cell():
    # Colab / a fresh kernel: the first code cell installs jdp (with the notebook extras) when it is missing,
    # the same cell in every notebook, so the source it installs from is set the same way everywhere
    import json
    firsts = {}
    for path in sorted((DOCS.parent / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        firsts[path.name] = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    assert len(firsts) >= 5 and len(set(firsts.values())) == 1, firsts
    cell = next(iter(firsts.values()))
    assert 'if importlib.util.find_spec("jdp") is None:' in cell
    assert '%pip install -q "jdp-privacy[notebook] @ {JDP_SOURCE}"' in cell


def _install_cell_sources(cwd, monkeypatch, env_source=None):
    """Runs the notebooks' install cell where jdp is NOT importable, its `%pip` line captured: the sources
    it would install from."""
    import importlib.util
    import json
    path = DOCS.parent / "notebooks" / "dpformer.ipynb"
    cell = "".join(next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")["source"])
    code = cell.replace('%pip install -q "jdp-privacy[notebook] @ {JDP_SOURCE}"', "INSTALLED.append(JDP_SOURCE)")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jdp" else real(name, *a))
    monkeypatch.chdir(cwd)
    if env_source is None:
        monkeypatch.delenv("JDP_SOURCE", raising=False)
    else:
        monkeypatch.setenv("JDP_SOURCE", env_source)
    installed = []
    exec(compile(code, str(path), "exec"), {"INSTALLED": installed})
    return installed


def test_install_cell_installs_from_the_checkout_it_runs_in_or_the_source_given(tmp_path, monkeypatch):
    root = DOCS.parent
    assert _install_cell_sources(root / "notebooks", monkeypatch) == [root.resolve().as_uri()]
    assert _install_cell_sources(tmp_path, monkeypatch, "git+https://example.org/jdp.git") == [
        "git+https://example.org/jdp.git"]
    with pytest.raises(RuntimeError, match="set JDP_SOURCE"):
        _install_cell_sources(tmp_path, monkeypatch)
