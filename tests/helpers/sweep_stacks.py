"""A stand-in for a sweep's stack factory (`open_stack(mode)`) in the sweep runners' unit tests:
it yields `url-<mode>` and records ("start", mode) and ("stop", mode) in `events`, so a test
sees which stacks were up while each slice was measured."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager


def recording_stacks(events: list[tuple]) -> Callable[[str], AbstractContextManager[str]]:
    @contextlib.contextmanager
    def open_stack(mode: str) -> Iterator[str]:
        events.append(("start", mode))
        try:
            yield f"url-{mode}"
        finally:
            events.append(("stop", mode))

    return open_stack
