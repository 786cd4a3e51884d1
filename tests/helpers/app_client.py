"""A server's app in process (one model load, no server process) for the HTTP attack tests, and
the check that an attack left nothing behind."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi.testclient import TestClient

from kvpipe.config import ServerConfig
from kvpipe.qa.checks import failed
from kvpipe.qa.leaks import pool_checks
from kvpipe.server.app_state import ServerState
from kvpipe.server.http_server import create_app


@contextlib.contextmanager
def app_client(cfg: ServerConfig, headers: dict[str, str] | None = None) -> Iterator[tuple[TestClient, ServerState]]:
    """A test client of `create_app(cfg)` once its engine loaded, and the app's state."""
    app = create_app(cfg)
    with TestClient(app, raise_server_exceptions=False, headers=headers) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "engine did not load"
            time.sleep(0.1)
        yield client, app.state.kvpipe


def assert_back_to_idle(state: ServerState, timeout_s: float = 60.0) -> None:
    """No request held by the server or its engine, every KV page free (kvpipe/qa/leaks.py, the
    check the soak and chaos runs use)."""
    deadline, problems = time.monotonic() + timeout_s, ["not checked"]
    while time.monotonic() < deadline:
        problems = failed(pool_checks("server", state.engine.stats() or {}))
        if state.engine.num_active():
            problems.append(f"the server holds {state.engine.num_active()} requests")
        if not problems:
            return
        time.sleep(0.1)
    raise AssertionError(f"resources not back after the attack: {problems}")


def wait_held(state: ServerState, n: int, timeout_s: float = 60.0) -> None:
    """Until the server holds n requests."""
    deadline = time.monotonic() + timeout_s
    while state.engine.num_active() < n:
        assert time.monotonic() < deadline, f"only {state.engine.num_active()} of {n} requests arrived"
        time.sleep(0.02)


class InBackground:
    """`post()` called from threads; `outs` gets each one's answer."""

    def __init__(self, post: Callable[[int], Any], n: int) -> None:
        self.outs: list[Any] = []
        self._post = post
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        self.outs.append(self._post(i))

    def join(self, timeout_s: float = 120.0) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)
            assert not t.is_alive()
