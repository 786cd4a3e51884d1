"""Fixtures shared by the integration tests (tests/conftest.py marks every test here
`integration`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.pd_pair import Reference, colocated_greedy


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """What a test starts in-process (bootstrap servers, senders, receivers, backends), closed in
    reverse order at its end. The router PD tests' modules define their own `stack`: a PD stack."""
    with contextlib.ExitStack() as es:
        yield es


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Iterator[Reference]:
    """Greedy generations (tokens and logprobs) of the colocated engine on the tiny preset with no
    prefix cache (memoized). Modules on another model define their own `reference`."""
    yield from colocated_greedy(tiny_model_dir)
