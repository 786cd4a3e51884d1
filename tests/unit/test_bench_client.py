"""Load-generator bookkeeping: SSE parsing, token counting, error capture (no real network:
httpx's MockTransport answers with fixed SSE bodies; nothing is timed)."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from kvpipe.bench.client import DONE, drive, event_error, event_tokens, parse_sse_line
from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def test_parse_sse_line() -> None:
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line('data: {"text": "a"}') == {"text": "a"}
    assert parse_sse_line("") is None and parse_sse_line(": keepalive") is None and parse_sse_line("event: x") is None
    with pytest.raises(ValueError):
        parse_sse_line("data: {broken")


def test_event_tokens_and_errors() -> None:
    assert event_tokens({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}}) == 3
    assert event_tokens({"output_ids": [5, 6]}) == 2  # no meta_info: count the cumulative ids
    assert event_error({"error": {"message": "too long"}}) == "too long"
    assert event_error({"meta_info": {"finish_reason": {"type": "abort", "message": "bye"}}}) == "aborted: bye"
    assert event_error({"meta_info": {"finish_reason": {"type": "length"}}}) is None


def _workload(n: int = 3, out: int = 3):
    cfg = WorkloadConfig(parse_lengths("8"), parse_lengths(str(out)), n, vocab_size=50)
    return build_workload(cfg)


def _events(k: int) -> list[dict]:
    return [{"text": "x" * i, "output_ids": list(range(i)),
             "meta_info": {"completion_tokens": i, "finish_reason": {"type": "length"} if i == k else None}}
            for i in range(1, k + 1)]


def test_drive_records_every_token_event() -> None:
    seen_bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen_bodies.append(body)
        k = body["sampling_params"]["max_new_tokens"]
        return httpx.Response(200, content=sse(*_events(k), b"[DONE]"), headers={"content-type": "text/event-stream"})

    ticks = itertools.count()  # a fake clock: each reading one unit later
    wl = _workload()
    res = asyncio.run(drive("http://bench.test/generate", wl, concurrency=2, timeout_s=30, progress=False,
                            transport=httpx.MockTransport(handler), clock=lambda: float(next(ticks))))
    assert [b["input_ids"] for b in sorted(seen_bodies, key=lambda b: b["input_ids"])] == \
        sorted(list(r.input_ids) for r in wl.requests)
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] for b in seen_bodies)
    for rec in res.records:
        assert rec.ok, rec.error
        assert rec.token_counts == [1, 2, 3]
        assert rec.start_s < rec.token_times[0] < rec.token_times[-1] <= rec.end_s
    assert res.duration_s > 0


def test_drive_captures_errors_per_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        first = json.loads(request.content)["input_ids"][0]
        kind = first % 3
        if kind == 0:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if kind == 1:
            return httpx.Response(200, content=sse({"error": {"message": "bad prompt"}}, b"[DONE]"))
        return httpx.Response(200, content=sse(*_events(2), b"[DONE]"))  # short of the 3 asked for

    wl = _workload(n=12)
    assert {r.input_ids[0] % 3 for r in wl.requests} == {0, 1, 2}
    res = asyncio.run(drive("http://bench.test/generate", wl, concurrency=3, timeout_s=30, progress=False,
                            transport=httpx.MockTransport(handler)))
    for req, rec in zip(wl.requests, res.records):
        kind = req.input_ids[0] % 3
        assert not rec.ok
        if kind == 0:
            assert rec.error.startswith("HTTP 500") and "boom" in rec.error
        elif kind == 1:
            assert rec.error == "bad prompt"
        else:
            assert rec.error == "expected 3 output tokens, got 2"
