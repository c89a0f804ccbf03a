import os
import pathlib

import pytest

# Several fake CPU devices so sharded code paths are exercised on a CPU-only machine.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SHARED_DATASETS = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def datasets_dir() -> pathlib.Path:
    """../shared/datasets relative to the project root; tests needing it skip when absent."""
    if not SHARED_DATASETS.exists():
        pytest.skip("shared datasets not available")
    return SHARED_DATASETS
