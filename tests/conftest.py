"""Shared pytest fixtures, and the markers every test gets from its directory."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator
from pathlib import Path

# Set before torch loads libgomp, and inherited by every server a test starts. The tests' servers
# share 2 cores with the xdist workers and with each other, and libgomp's default spin-wait after
# each parallel region burns the core a peer needs: a server test module ran 1.5-2x slower beside
# two busy torch processes (31 tests: 42 s and 31 s spinning, 21 s and 20 s PASSIVE). Servers
# started outside the tests keep the default; `kvpipe launch` gives each part its own cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpipe.model.presets import write_preset

# Failed asserts inside the helpers explain themselves like those in the test modules.
pytest.register_assert_rewrite("tests.helpers")

TESTS = Path(__file__).parent
# directory -> the marker each of its tests carries (`-m "not integration"`: no servers, no
# subprocess fleets, no process groups; `-m "not gpu"`: no CUDA)
DIRECTORY_MARKERS = {TESTS / "integration": "integration", TESTS / "gpu": "gpu"}


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs the unit tests on 2 xdist workers (one per core): each worker computes on
    # one thread, or the two would each start a thread per core and fight for them
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for directory, marker in DIRECTORY_MARKERS.items():
            if item.path.is_relative_to(directory):
                item.add_marker(marker)


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back_after_each_module() -> Iterator[None]:
    """A test module's models (trained ones reach GBs) are garbage once it ends; hand their pages
    back to the OS so an xdist worker's RSS does not grow module by module (a worker at 10 GB met
    the OOM killer beside two servers of Gemma-3-270M)."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (seed 0) written once per test session as an HF checkpoint directory."""
    return write_preset("tiny", tmp_path_factory.mktemp("tiny_model"))
