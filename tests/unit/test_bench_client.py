"""Load-generator bookkeeping: SSE parsing, token counting, error capture (no real network:
httpx's MockTransport answers with fixed SSE bodies; nothing is timed)."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from kvpipe.bench.client import DONE, drive, event_error, event_tokens, parse_sse_line
from kvpipe.bench.latency import summarize
from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths, split_rounds


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
    return [
        {
            "text": "x" * i,
            "output_ids": list(range(i)),
            "meta_info": {"completion_tokens": i, "finish_reason": {"type": "length"} if i == k else None},
        }
        for i in range(1, k + 1)
    ]


def test_drive_records_every_token_event() -> None:
    seen_bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen_bodies.append(body)
        k = body["sampling_params"]["max_new_tokens"]
        return httpx.Response(200, content=sse(*_events(k), b"[DONE]"), headers={"content-type": "text/event-stream"})

    ticks = itertools.count()  # a fake clock: each reading one unit later
    wl = _workload()
    res = asyncio.run(
        drive(
            "http://bench.test/generate",
            wl,
            concurrency=2,
            timeout_s=30,
            progress=False,
            transport=httpx.MockTransport(handler),
            clock=lambda: float(next(ticks)),
        )
    )
    assert [b["input_ids"] for b in sorted(seen_bodies, key=lambda b: b["input_ids"])] == sorted(
        list(r.input_ids) for r in wl.requests
    )
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
    res = asyncio.run(
        drive(
            "http://bench.test/generate",
            wl,
            concurrency=3,
            timeout_s=30,
            progress=False,
            transport=httpx.MockTransport(handler),
        )
    )
    for req, rec in zip(wl.requests, res.records):
        kind = req.input_ids[0] % 3
        assert not rec.ok
        if kind == 0:
            assert rec.error.startswith("HTTP 500") and "boom" in rec.error
        elif kind == 1:
            assert rec.error == "bad prompt"
        else:
            assert rec.error == "expected 3 output tokens, got 2"


def _multi_turn(n: int = 6, turns: int = 3, groups: int = 0):
    cfg = WorkloadConfig(
        parse_lengths("8"),
        parse_lengths("2"),
        n,
        vocab_size=50,
        seed=3,
        num_turns=turns,
        turn_len=4,
        num_prefix_groups=groups,
        prefix_len=5 if groups else 0,
    )
    return build_workload(cfg)


def test_multi_turn_workload_and_rounds() -> None:
    wl = _multi_turn()
    assert [r.follows for r in wl.requests] == [None, 0, 1, None, 3, 4]
    assert [r.prompt_len for r in wl.requests] == [8, 4, 4, 8, 4, 4]  # follow-ups: new tokens only
    assert wl.requests[1].arrival_s == wl.requests[0].arrival_s
    assert [[q.index for q in w.requests] for w in split_rounds(wl, 1)] == [[0, 1, 2], [3, 4, 5]]
    single = build_workload(WorkloadConfig(parse_lengths("8"), parse_lengths("2"), 5, vocab_size=50, seed=3))
    assert [[q.index for q in w.requests] for w in split_rounds(single, 2)] == [[0, 1], [2, 3], [4]]
    grouped = _multi_turn(n=6, turns=2, groups=2)  # prefix groups go by conversation
    assert [r.prefix_group for r in grouped.requests] == [0, 0, 1, 1, 0, 0]
    assert grouped.requests[0].input_ids[:5] == grouped.requests[4].input_ids[:5]
    for bad in (dict(num_turns=0), dict(num_turns=2, turn_len=0), dict(num_turns=4, turn_len=1)):
        with pytest.raises(ValueError):
            WorkloadConfig(parse_lengths("8"), parse_lengths("2"), 6, vocab_size=50, **bad)


def test_multi_turn_resends_the_conversation_closed_loop() -> None:
    """A follow-up is sent after its previous turn finished, with that turn's prompt + its output
    ids + its own new tokens; a failed turn fails its follow-ups unsent; cached_tokens recorded."""
    wl = _multi_turn(n=6, turns=3)
    sent: list[list[int]] = []
    fail_first = wl.requests[3].input_ids  # the second conversation's first turn fails

    def handler(request: httpx.Request) -> httpx.Response:
        ids = json.loads(request.content)["input_ids"]
        sent.append(ids)
        if ids == list(fail_first):
            return httpx.Response(500, json={"error": {"message": "boom"}})
        out = [len(ids), len(ids) + 1]  # the "model" answers with the prompt length
        evs = [
            {"output_ids": out[:i], "meta_info": {"completion_tokens": i, "cached_tokens": 16 * (i - 1)}}
            for i in (1, 2)
        ]
        return httpx.Response(200, content=sse(*evs, b"[DONE]"), headers={"content-type": "text/event-stream"})

    res = asyncio.run(
        drive(
            "http://bench.test/generate",
            wl,
            concurrency=2,
            timeout_s=30,
            progress=False,
            transport=httpx.MockTransport(handler),
        )
    )
    t0, t1, t2 = (list(wl.requests[i].input_ids) for i in range(3))
    turn1 = t0 + [8, 9] + t1
    assert sent.count(t0) == 1 and turn1 in sent and turn1 + [14, 15] + t2 in sent
    assert sent.index(turn1) > sent.index(t0)
    recs = res.records
    assert [r.ok for r in recs] == [True, True, True, False, False, False]
    assert [r.prompt_len for r in recs[:3]] == [8, 14, 20] and recs[2].cached_tokens == 16
    assert "request 3" in recs[4].error and "request 4" in recs[5].error  # never sent
    assert len(sent) == 4
    s = summarize(recs, 1.0)
    assert s["cached_tokens_mean"] == 16.0 and s["prompt_tokens_mean"] == 14.0
