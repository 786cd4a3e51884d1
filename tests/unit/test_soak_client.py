"""The soak client's judgement of answers (pure), and `run_one` against an httpx MockTransport:
success, clear and unclear errors, our own disconnects, and a stream that stalls past its
deadline (a hang)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvpipe.qa.soak_book import Outcome
from kvpipe.qa.soak_client import judge_http_error, judge_object, run_one
from kvpipe.qa.soak_plan import Kind, PlannedRequest


def test_judge_http_errors() -> None:
    v = judge_http_error(500, json.dumps({"error": {"message": "KV transfer failed for room 7"}}))
    assert v.outcome is Outcome.ERROR and v.message == "HTTP 500: KV transfer failed for room 7"
    assert judge_http_error(422, "Failed to deserialize").outcome is Outcome.ERROR
    assert judge_http_error(502, "").outcome is Outcome.UNCLEAR
    assert judge_http_error(500, json.dumps({"error": {"message": ""}})).outcome is Outcome.UNCLEAR


def test_judge_bodies_and_events() -> None:
    gen = lambda fin, n=4: {"meta_info": {"finish_reason": fin, "completion_tokens": n}}  # noqa: E731
    assert judge_object(Kind.GENERATE, gen({"type": "length"}), 4, final=True).outcome is Outcome.SUCCESS
    assert judge_object(Kind.GENERATE, gen({"type": "length"}, 3), 4, final=True).outcome is Outcome.UNCLEAR
    v = judge_object(Kind.GENERATE, gen({"type": "abort", "message": "KV transfer failed"}), 4, final=False)
    assert v.outcome is Outcome.ERROR and "KV transfer failed" in v.message
    assert judge_object(Kind.GENERATE, gen({"type": "abort"}), 4, final=True).outcome is Outcome.UNCLEAR
    assert judge_object(Kind.GENERATE, gen(None), 4, final=False).outcome is None
    assert judge_object(Kind.GENERATE, gen(None), 4, final=True).outcome is Outcome.UNCLEAR
    chat = {"choices": [{"finish_reason": "length", "message": {}}], "usage": {"completion_tokens": 4}}
    assert judge_object(Kind.CHAT, chat, 4, final=True).outcome is Outcome.SUCCESS
    assert judge_object(Kind.COMPLETION, {"choices": [{"finish_reason": "abort"}]}, 4, True).outcome is Outcome.UNCLEAR
    assert judge_object(Kind.CHAT, {"error": {"message": "boom"}}, 4, False).outcome is Outcome.ERROR


def _req(stream: bool, disconnect_after: int | None = None, kind: Kind = Kind.GENERATE) -> PlannedRequest:
    return PlannedRequest(
        0,
        kind,
        stream,
        3,
        (5, 6, 7) if kind is Kind.GENERATE else None,
        None if kind is Kind.GENERATE else "abc",
        4,
        disconnect_after,
    )


def _sse(*objs: object) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def _events(n: int, total: int = 4) -> list[dict]:
    return [
        {"meta_info": {"completion_tokens": i + 1, "finish_reason": {"type": "length"} if i + 1 == total else None}}
        for i in range(n)
    ]


class _Body(httpx.AsyncByteStream):
    """A response body that yields `chunks`, then stalls (`hang`) or ends; records if it was closed."""

    def __init__(self, chunks: list[bytes], hang: bool = False) -> None:
        self.chunks, self.hang, self.closed = chunks, hang, False

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.hang:
            await asyncio.sleep(3600)

    async def aclose(self) -> None:
        self.closed = True


def _run(req: PlannedRequest, response: httpx.Response, deadline_s: float = 5.0):
    async def go():
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(transport=transport) as client:
            return await run_one(client, "http://x", req, "m", deadline_s)

    return asyncio.run(go())


def test_run_one_outcomes() -> None:
    ok = _run(_req(False), httpx.Response(200, json=_events(4)[-1]))
    assert ok.outcome is Outcome.SUCCESS and ok.status == 200 and ok.latency_s is not None
    streamed = _run(_req(True), httpx.Response(200, stream=_Body([_sse(*_events(4), b"[DONE]")])))
    assert streamed.outcome is Outcome.SUCCESS, streamed.message
    err = _run(_req(False), httpx.Response(500, json={"error": {"message": "KV transfer failed"}}))
    assert (err.outcome, err.status, err.message) == (Outcome.ERROR, 500, "HTTP 500: KV transfer failed")
    cut = _run(_req(True), httpx.Response(200, stream=_Body([_sse(*_events(4)[:3])])))
    assert cut.outcome is Outcome.UNCLEAR and "without [DONE]" in cut.message


def test_run_one_disconnects_after_k_events() -> None:
    body = _Body([_sse(*_events(3, total=64))], hang=True)  # the server would go on for long
    r = _run(_req(True, disconnect_after=2), httpx.Response(200, stream=body))
    assert r.outcome is Outcome.DISCONNECTED and r.message == "closed by us after 2 events"
    assert body.closed


def test_run_one_stalled_stream_is_a_hang() -> None:
    body = _Body([_sse(*_events(1))], hang=True)
    r = _run(_req(True), httpx.Response(200, stream=body), deadline_s=0.3)
    assert r.outcome is Outcome.HANG and "0.3 s" in r.message and r.status is None


@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.COMPLETION])
def test_run_one_openai_stream_with_usage(kind: Kind) -> None:
    key = "delta" if kind is Kind.CHAT else "text"
    chunks = [
        {"choices": [{key: "x", "finish_reason": None}]},
        {"choices": [{key: "y", "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 4}},
    ]
    r = _run(_req(True, kind=kind), httpx.Response(200, stream=_Body([_sse(*chunks, b"[DONE]")])))
    assert r.outcome is Outcome.SUCCESS, r.message
    short = [*chunks[:2], {"choices": [], "usage": {"completion_tokens": 2}}]
    r = _run(_req(True, kind=kind), httpx.Response(200, stream=_Body([_sse(*short, b"[DONE]")])))
    assert r.outcome is Outcome.UNCLEAR and "expected 4" in r.message
