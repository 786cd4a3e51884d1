"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.model.presets import write_preset


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (seed 0) written once per test session as an HF checkpoint directory."""
    return write_preset("tiny", tmp_path_factory.mktemp("tiny_model"))
