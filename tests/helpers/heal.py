"""Service after a link heals, through a PD stack's router (tests/integration/test_router_heal.py,
test_relink.py)."""

from __future__ import annotations

import time
from typing import Any

import httpx


def served_after(url: str, body: dict[str, Any], deadline_s: float) -> tuple[dict[str, Any], float, int]:
    """POST `body` to url/generate until one answer is 200 (503/500 while the router has no healthy
    pair, or while a transfer fails); returns (answer, seconds from the first try, failed tries)."""
    t0, failed = time.monotonic(), 0
    while time.monotonic() - t0 < deadline_s:
        try:
            r = httpx.post(url + "/generate", json=body, timeout=60.0)
            if r.status_code == 200:
                return r.json(), time.monotonic() - t0, failed
        except httpx.HTTPError:
            pass
        failed += 1
        time.sleep(0.25)
    raise AssertionError(f"no request served within {deadline_s}s of the heal ({failed} tries failed)")
