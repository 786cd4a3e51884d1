"""The engine's one lock-protected inbox: what other threads hand the engine thread.

add_request and abort may come from any thread (the server's event loop, a client's
disconnect); step() takes everything at once. The inbox also keeps the rids still active
(added, and their pages not all free yet), so a duplicate rid is refused where it arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvpipe.engine.request import Req


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[Req] = []
        self._aborts: list[str] = []
        self._active: set[str] = set()  # rids added whose pages are not all free yet
        self._closed = False

    def add(self, req: Req, claim: Callable[[Req], None] | None = None) -> None:
        """Queue `req` (any thread). ValueError: its rid is still active, or `claim` (the
        connector's, called under the lock) refuses it; RuntimeError: the engine is shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            if req.rid in self._active:
                raise ValueError(f"a request with rid {req.rid!r} is already running")
            if claim is not None:
                claim(req)
            self._active.add(req.rid)
            self._new.append(req)

    def abort(self, rid: str) -> None:
        with self._lock:
            self._aborts.append(rid)

    def take(self) -> tuple[list[Req], list[str]]:
        """Everything queued since the last call: (new requests, rids to abort)."""
        with self._lock:
            new, aborts = self._new, self._aborts
            self._new, self._aborts = [], []
        return new, aborts

    def pending(self) -> bool:
        """Something waits for the engine thread."""
        with self._lock:
            return bool(self._new or self._aborts)

    def num_new(self) -> int:
        with self._lock:
            return len(self._new)

    def release(self, rid: str) -> None:
        """`rid`'s pages are all free: a new request may take it."""
        with self._lock:
            self._active.discard(rid)

    def close(self) -> bool:
        """Refuse new requests from now; False when it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True
