"""benchmarks/: one folder per capability, a summary README generated from the result files, links that resolve."""
import pathlib

from benchmarks import check_links, render_readme
from benchmarks.common import NAV, RENAMED, current_names, results_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_committed_summary_is_the_rendered_one():
    assert (ROOT / "benchmarks" / "README.md").read_text() == render_readme.render(), (
        "run `python -m benchmarks.render_readme`")


def test_summary_links_every_capability_page():
    text = render_readme.render()
    for cap, _ in render_readme.CAPABILITIES:
        folder = ROOT / "benchmarks" / cap
        assert f"]({cap}/README.md)" in text, cap
        assert (folder / "README.md").is_file() and (folder / "NOTES.md").is_file(), cap
        assert (folder / "README.md").read_text().startswith(NAV), cap  # one click back to the summary
        assert (folder / "results").is_dir() and (folder / "__init__.py").is_file(), cap


def test_every_relative_link_resolves():
    assert not check_links.broken_links()


def test_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(check_links, "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title here\n\n[ok](#title-here) [bad](#nope) [gone](b.md) `[code](c.md)`\n")
    assert check_links.broken_links([tmp_path / "a.md"]) == [
        "a.md: #nope (no such anchor)", "a.md: b.md (no such file)"]


def test_old_script_names_map_to_existing_modules():
    for new in RENAMED.values():
        assert (ROOT / "benchmarks" / (new.replace(".", "/") + ".py")).is_file(), new
    assert current_names("python -m benchmarks.seqrec_speed --x; benchmarks/results/clipping_b256.json") == (
        "python -m benchmarks.seqrec.speed --x; benchmarks/clipping/results/clipping_b256.json")
    assert results_dir(ROOT / "benchmarks" / "meta" / "experiments.py") == ROOT / "benchmarks" / "meta" / "results"


def test_write_results_goes_to_the_calling_scripts_results_folder(tmp_path):
    scope = {"__file__": str(tmp_path / "cap" / "script.py")}
    exec("from benchmarks.common import write_results\npath = write_results('x', [{'a': 1}], command='c')", scope)
    assert scope["path"] == tmp_path / "cap" / "results" / "x.json" and scope["path"].is_file()
