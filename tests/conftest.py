import gc
import os
import pathlib
import tempfile

import pytest

# Several fake CPU devices so sharded code paths are exercised on a CPU-only machine. Unit tests run tiny programs,
# so their time is XLA's compilation: backend optimisation level 0 (LLVM codegen only; the same HLO and numerics
# contract) cut two test files' wall time by 42% on 2 cores. Runs outside the tests keep the default. On a GPU
# (JAX_PLATFORMS=cuda, `make test-gpu`) the level stays XLA's own (only the CPU's gain was measured), and
# scatter-adds run in a fixed order: some tests compare two runs bit for bit, and atomic adds moved the last bit
# of a sum between runs.
_FLAGS = "--xla_force_host_platform_device_count=4 " + (
    "--xla_backend_optimization_level=0" if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
    else "--xla_gpu_deterministic_ops=true")
os.environ.setdefault("XLA_FLAGS", _FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# CLI entry points turn on JAX's persistent compilation cache (jdp.cli.enable_compilation_cache); tests call
# them in-process, so keep the user's cache out of it: no writes there, and no programs compiled on an earlier day.
os.environ.setdefault("JDP_COMPILATION_CACHE", "off")
# Instead each test process gets an EMPTY cache of its own, removed at exit: tests that train the same program
# again (resume from a checkpoint, a second seed, a CLI run after a library run) load it instead of compiling it
# anew (a toy DPFormer step: ~10 s to compile, ~2 s to load). Every program is still compiled once per run.
import jax  # noqa: E402  (after the environment above, which jax reads when it starts)

_COMPILE_CACHE = tempfile.TemporaryDirectory(prefix="jdp-test-xla-")
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# Each compiled CPU program holds three memory mappings (code, constants, data) per object XLA emits for it (6 for a
# tiny program), for as long as its jitted function lives, and JAX keeps a module-level function's programs (up to
# 8,192 per cache). Linux caps a process at vm.max_map_count mappings (65,530 by default): the whole default suite
# in one process (no xdist; a long notebook alike) reached it at about 70% of the tests, and XLA then failed to map
# a new program ("LLVM compilation error: Cannot allocate memory") and crashed the process with a segmentation fault
# instead of raising, compiling it or serializing it for the cache above (issue 74; docs/performance.md: the repro,
# and what a user does about it). So past half the limit, each test file ends by dropping every compiled program
# (later files compile theirs again, or load them from the cache above). xdist workers, each running a quarter of
# the files, seldom get there (the one-process run: `make test-one-process`).
def _memory_mappings() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit), or None where /proc does not tell (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_near_the_mapping_limit():
    yield
    usage = _memory_mappings()
    if usage is not None and usage[0] > usage[1] // 2:
        jax.clear_caches()
        gc.collect()


def pytest_collection_modifyitems(config, items):
    """`multi_device` tests skip on a platform with fewer than four devices (a one-GPU machine); on the CPU conftest
    always gives four, so there they run."""
    if jax.default_backend() == "cpu" or len(jax.devices()) >= 4:
        return
    skip = pytest.mark.skip(reason="needs four devices (conftest gives the CPU four)")
    for item in items:
        if item.get_closest_marker("multi_device"):
            item.add_marker(skip)


SHARED_DATASETS = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def datasets_dir() -> pathlib.Path:
    """../shared/datasets relative to the project root; tests needing it skip when absent."""
    if not SHARED_DATASETS.exists():
        pytest.skip("shared datasets not available")
    return SHARED_DATASETS


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def run_on_host_devices(tmp_path_factory):
    """run(script, devices=4, timeout=...) -> dict of the arrays the script saved with np.savez(sys.argv[1], ...):
    the script runs in a subprocess whose jax has `devices` host-platform devices (the count is fixed when jax
    starts), with a timeout so that a collective's deadlock fails the test instead of blocking the suite."""
    import subprocess
    import sys

    import numpy as np

    def run(script: str, devices: int = 4, timeout: int = 600) -> dict:
        out = tmp_path_factory.mktemp("host_devices") / "out.npz"
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
               "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        try:
            proc = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {devices}-device run did not finish in {timeout} s (deadlock?)")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return dict(np.load(out))

    return run


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
        run.last = nb  # the executed notebook, for tests that check its figures
        return "".join(o.get("text", "") for o in outputs), [o for o in outputs if o.get("output_type") == "error"]

    return run
