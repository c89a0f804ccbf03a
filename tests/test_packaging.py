"""The distribution name: `jdp` on PyPI is an unrelated project, so nothing may tell users to install it.

The distribution is `jdp-privacy`; the import package and the console command stay `jdp`. Users install
from a checkout (`pip install -e ".[extra]"`), a source archive of the repository, or a wheel built by
`make wheel` (docs/install.md).
"""
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "jdp-privacy"


def _project_name() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the [project] table's name line
        match = re.search(r'^\[project\][^\[]*?^name\s*=\s*"([^"]+)"', text, re.M | re.S)
        assert match, "pyproject.toml has no [project] name"
        return match.group(1)
    return tomllib.loads(text)["project"]["name"]


def _project_version() -> str:
    match = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert match, "pyproject.toml has no [project] version"
    return match.group(1)


def test_documented_wheel_names_are_this_version():
    # README / docs/install.md spell the wheel `make wheel` builds: its name must be the one it builds
    found = []
    for path in (ROOT / "README.md", ROOT / "docs" / "install.md"):
        found += re.findall(r"jdp_privacy-([0-9][\w.]*)-py3-none-any\.whl", path.read_text())
    assert found and set(found) == {_project_version()}, found


def _normalise(name: str) -> str:  # PEP 503
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_is_not_named_like_the_unrelated_pypi_project():
    name = _project_name()
    assert _normalise(name) != "jdp", "the name 'jdp' on PyPI belongs to someone else"
    assert name == DISTRIBUTION
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^jdp = "jdp\.cli:entry_point"$', text, re.M), "the console command stays `jdp`"


# `pip install jdp`, `pip install -q jdp`, `pip install "jdp[cuda]"`, `'jdp[plots]'`, `jdp[notebook] @ ...`:
# any install of the bare name `jdp` (with or without extras) resolves to the unrelated project on PyPI
_BARE_NAME_INSTALL = re.compile(r"""pip3?\s+install\s+(?:-{1,2}[\w-]+\s+)*["']?jdp(?:\[|["'\s]|$)""", re.M)
_BARE_NAME_EXTRA = re.compile(r"""(?<![\w.-])jdp\[""")


def _user_facing_texts():
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.ipynb")),
             *sorted((ROOT / "jdp").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.md")), ROOT / "Makefile"]
    return [p for p in paths if p.is_file()]


def test_no_text_tells_users_to_install_the_bare_name():
    offenders = []
    for path in _user_facing_texts():
        text = path.read_text().replace('\\"', '"')  # notebooks: JSON-escaped quotes
        for pattern in (_BARE_NAME_INSTALL, _BARE_NAME_EXTRA):
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not offenders, offenders
    # the patterns do catch what they must, and let the right spellings through
    for bad in ('pip install jdp', 'pip install -q jdp\n', 'pip install "jdp[cuda]"', "pip install 'jdp[plots]'",
                '%pip install -q "jdp[notebook] @ {JDP_SOURCE}"'):
        assert _BARE_NAME_INSTALL.search(bad) or _BARE_NAME_EXTRA.search(bad), bad
    for good in ('pip install -e ".[cuda]"', '%pip install -q "jdp-privacy[notebook] @ {JDP_SOURCE}"',
                 'pip install "jdp-privacy @ git+https://example.org/jdp.git"', "pip install mkl", "import jdp"):
        assert not (_BARE_NAME_INSTALL.search(good) or _BARE_NAME_EXTRA.search(good)), good


def test_notebooks_install_the_renamed_distribution_with_its_extra():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f'%pip install -q \\"{DISTRIBUTION}[notebook] @ {{JDP_SOURCE}}\\"' in path.read_text(), path.name


@pytest.mark.slow
def test_installed_metadata_keeps_the_import_package_and_the_command():
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION} is not installed here (run `make install` or `pip install -e .`)")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts.get("jdp") == "jdp.cli:entry_point"
    assert DISTRIBUTION in importlib.metadata.packages_distributions().get("jdp", [])
    out = subprocess.run([sys.executable, "-c", "import jdp, jdp.cli; print(jdp.__version__)"],
                         capture_output=True, text=True, cwd="/", check=True).stdout.strip()
    assert out == dist.version
