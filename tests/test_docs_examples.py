"""Every package guide in docs/ has the same sections, and its minimal example runs as written.

The example is the first ```python block under `## Minimal example`; it runs in a fresh namespace
(examples assert their own privacy claims, e.g. the report's ε). Examples whose compilation takes
most of a minute are marked slow (run with `-m slow`).

The README's Python blocks run as written too, each in a fresh namespace, except blocks marked schematic (a
```python-schematic fence, or a first line `# schematic`): excluded on purpose, and nothing else is."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

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


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in GUIDES])
def test_minimal_example_runs(name, capsys):
    code = minimal_example((DOCS / f"{name}.md").read_text())
    exec(compile(code, f"docs/{name}.md", "exec"), {"__name__": f"docs_{name}"})
    assert capsys.readouterr().out.strip(), "the example prints what it computed"


README = DOCS.parent / "README.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
README_LANGUAGES = {"python", "python-schematic", "bash"}
SLOW_IMPORTS = ("jdp.altmin", "jdp.meta", "jdp.seqrec")  # a whole private fit compiles: slow, like the guides


def is_schematic(language: str, code: str) -> bool:
    return language == "python-schematic" or (language == "python" and code.lstrip().startswith("# schematic"))


def readme_python_blocks(text: str) -> list[str]:
    """The README's Python blocks that must run: every ```python block not marked schematic."""
    return [code for lang, code in FENCE.findall(text) if lang.strip() == "python" and not is_schematic("python", code)]


def test_readme_blocks_are_runnable_python_or_marked_schematic():
    blocks = [(lang.strip(), code) for lang, code in FENCE.findall(README.read_text())]
    # every block names its language, so no Python hides in an untagged or differently tagged fence
    assert blocks and {lang for lang, _ in blocks} <= README_LANGUAGES, [lang for lang, _ in blocks]
    python = [(lang, code) for lang, code in blocks if lang.startswith("python")]
    run = readme_python_blocks(README.read_text())
    # excluded = exactly the marked ones
    assert len(python) - len(run) == sum(is_schematic(lang, code) for lang, code in python)
    assert len(run) >= 2, "the ten lines and the entry points run"
    assert is_schematic("python-schematic", "x = f(y)\n") and is_schematic("python", "# schematic\nx = f(y)\n")
    assert not is_schematic("python", "x = 1  # schematic\n")
    assert readme_python_blocks("```python\na = 1\n```\n```python-schematic\nb\n```\n```python\n# schematic\nc\n```\n") \
        == ["a = 1\n"]


def _readme_params():
    return [pytest.param(code, id=f"readme-python-{i}",
                         marks=[pytest.mark.slow] if any(m in code for m in SLOW_IMPORTS) else [])
            for i, code in enumerate(readme_python_blocks(README.read_text()))]


@pytest.mark.parametrize("code", _readme_params())
def test_readme_python_block_runs(code, capsys):
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip(), "the block prints what it computed"


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (DOCS.parent / "Makefile").read_text(), flags=re.M))
    used = {name: set(re.findall(r"\bmake ([a-z][\w-]*)", (DOCS.parent / name).read_text()))
            for name in ("README.md", "docs/install.md", "docs/performance.md")}
    assert {"demo", "test", "wheel"} <= used["README.md"], used  # the two commands, and the wheel for Colab
    assert set().union(*used.values()) <= targets, set().union(*used.values()) - targets


def test_readme_is_short_and_links_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 120
    assert "<" + "jdp's git repository>" not in text and "git+https://<" not in text  # no placeholder URL
    for name in ["install", "performance", "privacy", *GUIDES]:
        assert f"docs/{name}.md" in text, name
    for link in re.findall(r"\]\(((?:docs|notebooks|benchmarks)/[^)#]+)", text):
        assert (DOCS.parent / link).exists(), link


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
    assert 'glob("jdp_privacy-*.whl")' in cell  # Colab: the uploaded wheel (docs/install.md#colab)


def _install_cell_sources(cwd, monkeypatch, env_source=None, pip=None):
    """Runs the notebooks' install cell where jdp is NOT importable, its `%pip` line captured: the sources
    it would install from (or, given `pip`, pip(requirement) runs in its place)."""
    import importlib.util
    path = DOCS.parent / "notebooks" / "dpformer.ipynb"
    cell = "".join(next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")["source"])
    pip_line = '%pip install -q "jdp-privacy[notebook] @ {JDP_SOURCE}"'
    assert pip_line in cell
    code = cell.replace(pip_line, "INSTALLED.append(JDP_SOURCE); PIP(f\"jdp-privacy[notebook] @ {JDP_SOURCE}\")")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jdp" else real(name, *a))
    monkeypatch.chdir(cwd)
    if env_source is None:
        monkeypatch.delenv("JDP_SOURCE", raising=False)
    else:
        monkeypatch.setenv("JDP_SOURCE", env_source)
    installed = []
    exec(compile(code, str(path), "exec"), {"INSTALLED": installed, "PIP": pip or (lambda requirement: None)})
    return installed


def test_install_cell_installs_from_the_source_given_an_uploaded_wheel_or_the_checkout(tmp_path, monkeypatch):
    root = DOCS.parent
    assert _install_cell_sources(root / "notebooks", monkeypatch) == [root.resolve().as_uri()]
    assert _install_cell_sources(tmp_path, monkeypatch, "git+https://example.org/jdp.git") == [
        "git+https://example.org/jdp.git"]
    with pytest.raises(RuntimeError, match=r"upload the wheel that `make wheel` builds .* or set JDP_SOURCE"):
        _install_cell_sources(tmp_path, monkeypatch)
    # Colab: the wheel uploaded to the working directory, as a file URL (a PEP 508 direct reference)
    wheel = tmp_path / "jdp_privacy-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert _install_cell_sources(tmp_path, monkeypatch) == [wheel.resolve().as_uri()]
    # a relative path in JDP_SOURCE (the name of an uploaded archive) is made a file URL; it wins over the wheel
    (tmp_path / "jdp.zip").write_bytes(b"")
    assert _install_cell_sources(tmp_path, monkeypatch, "jdp.zip") == [(tmp_path / "jdp.zip").resolve().as_uri()]
    # given, but neither a path nor a URL: refused, not replaced by another source
    with pytest.raises(FileNotFoundError, match=r"JDP_SOURCE='jdp-main.zip' is neither a path .* nor a URL"):
        _install_cell_sources(tmp_path, monkeypatch, "jdp-main.zip")
    # two wheels: which one is meant is not guessed
    (tmp_path / "jdp_privacy-0.2.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"2 jdp wheels in .*keep one, or set JDP_SOURCE"):
        _install_cell_sources(tmp_path, monkeypatch)


def test_saved_notebooks_hold_no_widget_state_or_widget_outputs():
    # a saved tqdm widget shows a bar frozen at its first frame (or "Loading widget...") on GitHub and Colab
    for path in sorted((DOCS.parent / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        assert "widgets" not in nb["metadata"], path.name
        outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
        assert not [o for o in outs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})], path.name


def test_execute_script_drops_widgets_when_it_saves():
    import nbformat
    sys.path.insert(0, str(DOCS.parent / "notebooks"))
    try:
        import execute
    finally:
        sys.path.pop(0)
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {}}})
    cell = nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("display_data", data={execute.WIDGET_VIEW: {"model_id": "m"}, "text/plain": "0%"}),
        nbformat.v4.new_output("stream", name="stdout", text="done\n")])
    nb.cells.append(cell)
    execute.strip_widgets(nb)
    assert "widgets" not in nb.metadata and [o["output_type"] for o in nb.cells[0].outputs] == ["stream"]


@pytest.mark.slow
def test_install_cell_installs_a_wheel_built_by_make_wheel_and_a_source_archive(tmp_path, monkeypatch):
    """`make wheel` in a copy of the sources, the wheel put where Colab's working directory would hold it, and
    the install cell's own requirement installed by pip (without dependencies, into a target folder: this
    environment has them) and imported from there; the same for a source archive given as JDP_SOURCE."""
    root = DOCS.parent
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "Makefile"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "jdp", src / "jdp", ignore=shutil.ignore_patterns("__pycache__"))
    archive = tmp_path / "upload" / "jdp.zip"  # a source archive of the same files, uploaded beside nothing else
    archive.parent.mkdir()
    shutil.make_archive(str(archive.with_suffix("")), "zip", src)
    built = subprocess.run(["make", "-s", "wheel", f"PYTHON={sys.executable}"], cwd=src, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = list((src / "dist").glob("jdp_privacy-*-py3-none-any.whl"))
    assert len(wheels) == 1, built.stdout
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert {"jdp/__init__.py", "jdp/cli.py", "jdp/py.typed", "jdp/seqrec/train.py"} <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "benchmarks/"))]

    def install_and_import(source_dir, env_source, target):
        def pip(requirement):
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                                requirement], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
        _install_cell_sources(source_dir, monkeypatch, env_source, pip=pip)
        out = subprocess.run([sys.executable, "-c", "import jdp, jdp.cli; print(jdp.__file__, jdp.__version__)"],
                             cwd=tmp_path, env={**_clean_env(), "PYTHONPATH": str(target)}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        where, version = out.stdout.split()
        assert pathlib.Path(where).is_relative_to(target) and version == wheels[0].name.split("-")[1]

    colab = tmp_path / "content"
    colab.mkdir()
    shutil.copy(wheels[0], colab / wheels[0].name)
    install_and_import(colab, None, tmp_path / "from_wheel")
    install_and_import(archive.parent, "jdp.zip", tmp_path / "from_archive")


def _clean_env():
    import os
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JDP_SOURCE")}
