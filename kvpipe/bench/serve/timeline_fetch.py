"""The measured requests' timelines, read back from the servers (`bench serve --timeline`).

sglang-router drops `return_timeline`, so the servers behind it (its worker list,
server/router_workers.py; a --url that is a server: that server) are asked for `/debug/requests`
after the warm-up and again after the run: the entries that are new are the run's (rids are
unique per server). The history holds `--debug-requests-history` requests (default 256): a run
with more keeps only its last ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from kvpipe.server.client_keys import client_headers
from kvpipe.server.router_workers import Worker, workers_or_self

Entries = dict[str, list[dict[str, Any]]]  # server role -> /debug/requests entries


class TimelineSnapshot:
    """The servers of `url` and the debug entries each held when `mark()` was called."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self._client = httpx.Client(timeout=timeout_s, headers=client_headers(url=url, admin=True))
        self.workers: list[Worker] = workers_or_self(self._client, url)
        self._seen: set[tuple[str, Any]] = set()

    def _read(self) -> list[tuple[str, dict[str, Any]]]:
        """(role, entry) of every server's history; the role as the server reports it."""
        out = []
        for w in self.workers:
            r = self._client.get(w.url.rstrip("/") + "/debug/requests")
            r.raise_for_status()
            body: Mapping[str, Any] = r.json()
            if body.get("recording") is False:
                raise RuntimeError(f"{w.url} records no timelines (--disable-request-metrics)")
            role = str(body.get("role") or w.role or "colocated")
            out += [(role, e) for e in body.get("requests", []) if isinstance(e, dict)]
        return out

    @staticmethod
    def _key(role: str, e: Mapping[str, Any]) -> tuple[str, Any]:
        return role, (e.get("rid"), e.get("bootstrap_room"))

    def mark(self) -> None:
        self._seen = {self._key(role, e) for role, e in self._read()}

    def new_entries(self) -> Entries:
        out: Entries = {}
        for role, e in self._read():
            if self._key(role, e) not in self._seen:
                out.setdefault(role, []).append(e)
        return out

    def close(self) -> None:
        self._client.close()
