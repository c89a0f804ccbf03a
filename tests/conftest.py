import os
import pathlib

import pytest

# Several fake CPU devices so sharded code paths are exercised on a CPU-only machine.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# CLI entry points turn on JAX's persistent compilation cache (jdp.cli.enable_compilation_cache); tests call
# them in-process, so keep it off here: no writes to the user's cache, and test times that a fresh machine sees.
os.environ.setdefault("JDP_COMPILATION_CACHE", "off")

SHARED_DATASETS = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def datasets_dir() -> pathlib.Path:
    """../shared/datasets relative to the project root; tests needing it skip when absent."""
    if not SHARED_DATASETS.exists():
        pytest.skip("shared datasets not available")
    return SHARED_DATASETS


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def run_notebook(monkeypatch):
    """Executes notebooks/<name> at tiny size (JDP_TINY=1); returns (text of all outputs, error outputs)."""
    import nbformat
    from nbclient import NotebookClient

    def run(name: str, timeout: int = 300):
        monkeypatch.setenv("JDP_TINY", "1")
        monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        return "".join(o.get("text", "") for o in outputs), [o for o in outputs if o.get("output_type") == "error"]

    return run
