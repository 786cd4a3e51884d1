"""Streams through a router while a server drains: how each ended (tests of the graceful drain,
kvpipe/server/drain.py), and the servers' pages and rooms before and after."""

from __future__ import annotations

import enum
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpipe.server.drain import DRAIN_LOG_PREFIX


class End(enum.Enum):
    OK = "ok"  # finished with every token asked for, then [DONE]
    ABORT = "abort"  # finish reason abort with a message (a drain: an error event too), then [DONE]
    HTTP_ERROR = "http_error"  # a non-200 answer with an error message
    CUT = "cut"  # anything else: no [DONE], no finish reason, a broken connection, no message
    HANG = "hang"  # no end within the deadline


@dataclass
class StreamResult:
    end: End
    detail: str = ""
    events: list[Any] = field(default_factory=list)

    @property
    def error_events(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]


def judge(events: list[Any], max_new_tokens: int) -> StreamResult:
    """A whole /generate stream (events parsed, "[DONE]" as the string) -> how it ended."""
    if not events or events[-1] != "[DONE]":
        return StreamResult(End.CUT, "no [DONE]", events)
    finals = [e for e in events if isinstance(e, dict) and (e.get("meta_info") or {}).get("finish_reason")]
    if not finals:
        return StreamResult(End.CUT, "no finish reason", events)
    reason = finals[-1]["meta_info"]["finish_reason"]
    if reason.get("type") == "abort":
        msg = str(reason.get("message") or "")
        return StreamResult(End.ABORT if msg else End.CUT, msg or "abort without a message", events)
    n = finals[-1]["meta_info"].get("completion_tokens")
    if n != max_new_tokens:
        return StreamResult(End.CUT, f"{n} tokens, asked for {max_new_tokens}", events)
    return StreamResult(End.OK, "", events)


def stream_generate(url: str, body: dict[str, Any], deadline_s: float) -> StreamResult:
    """POST a streamed /generate and read it to its end (bounded by `deadline_s`)."""
    events: list[Any] = []
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=deadline_s) as r:
            if r.status_code != 200:
                text = r.read().decode(errors="replace")
                try:
                    msg = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = ""
                return StreamResult(End.HTTP_ERROR if msg else End.CUT, f"HTTP {r.status_code}: {msg or text[:200]}")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[6:]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    except httpx.TimeoutException:
        return StreamResult(End.HANG, f"no end within {deadline_s} s", events)
    except httpx.HTTPError as e:
        return StreamResult(End.CUT, f"{type(e).__name__}: {e}", events)
    return judge(events, body["sampling_params"]["max_new_tokens"])


def run_streams(url: str, bodies: list[dict[str, Any]], deadline_s: float) -> tuple[list[threading.Thread], list]:
    """Start one thread per body streaming it; join the threads, then read the results list."""
    results: list[StreamResult | None] = [None] * len(bodies)

    def one(i: int) -> None:
        results[i] = stream_generate(url, bodies[i], deadline_s)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, results


def drain_summary(log: Path) -> dict[str, Any]:
    """The drain's summary line a server logged before it exited (drain.py)."""
    found = re.findall(re.escape(DRAIN_LOG_PREFIX) + r"(\{.*\})", log.read_text(errors="replace"))
    assert found, f"no drain summary in {log}"
    return json.loads(found[-1])


def pages_and_rooms(stats: dict[str, Any]) -> tuple[Any, ...]:
    """What must come back after a drain: free pages, the PD rooms, nothing running or held."""
    pd = stats.get("disaggregation") or {}
    busy = tuple(stats.get(k) for k in ("num_running", "num_waiting", "num_reserved", "num_held"))
    return (stats["free_pages"], pd.get("active_rooms"), pd.get("transfer_rooms"), *busy)


def wait_until(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    import time

    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
