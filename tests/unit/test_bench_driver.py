"""The load driver: SSE parsing, token counting, how each request ended (no real network: httpx's
MockTransport answers with fixed bodies; nothing is timed beyond a short deadline)."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths, split_rounds
from kvpipe.harness.answers import DONE, failure, output_tokens, parse_sse_line
from kvpipe.harness.driver import drive, send
from kvpipe.harness.latency import summarize
from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Api, Request


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def test_parse_sse_line() -> None:
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line('data: {"text": "a"}') == {"text": "a"}
    assert parse_sse_line("") is None and parse_sse_line(": keepalive") is None and parse_sse_line("event: x") is None
    with pytest.raises(ValueError):
        parse_sse_line("data: {broken")


def test_event_tokens_and_failures() -> None:
    g = Api.GENERATE
    assert output_tokens(g, {"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}}) == 3
    assert output_tokens(g, {"output_ids": [5, 6]}) == 2  # no meta_info: count the cumulative ids
    assert output_tokens(Api.CHAT, {"choices": [], "usage": {"completion_tokens": 4}}) == 4
    assert output_tokens(Api.CHAT, {"choices": [{"delta": "x"}]}) is None
    f = failure(g, {"error": {"message": "too long"}})
    assert f is not None and (f.message, f.reason) == ("too long", "too long")
    f = failure(g, {"meta_info": {"finish_reason": {"type": "abort", "message": "bye"}}})
    assert f is not None and (f.message, f.reason) == ("bye", "aborted: bye")
    f = failure(Api.COMPLETION, {"choices": [{"finish_reason": "abort"}]})  # OpenAI aborts carry no message
    assert f is not None and f.message == ""
    assert failure(g, {"meta_info": {"finish_reason": {"type": "length"}}}) is None


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
            "http://bench.test",
            wl.requests,
            concurrency=2,
            deadline_s=30,
            transport=httpx.MockTransport(handler),
            clock=lambda: float(next(ticks)),
        )
    )
    assert [b["input_ids"] for b in sorted(seen_bodies, key=lambda b: b["input_ids"])] == sorted(
        list(r.prompt) for r in wl.requests
    )
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] for b in seen_bodies)
    for rec in res.outcomes:
        assert rec.ok, rec.reason
        assert rec.token_counts == (1, 2, 3) and rec.events == 3 and rec.http_status == 200
        assert rec.start_s < rec.token_times[0] < rec.token_times[-1] <= rec.end_s
    assert res.duration_s > 0


def test_drive_captures_errors_per_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/generate"
        first = json.loads(request.content)["input_ids"][0]
        kind = first % 3
        if kind == 0:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if kind == 1:
            return httpx.Response(200, content=sse({"error": {"message": "bad prompt"}}, b"[DONE]"))
        return httpx.Response(200, content=sse(*_events(2), b"[DONE]"))  # short of the 3 asked for

    wl = _workload(n=12)
    assert {r.prompt[0] % 3 for r in wl.requests} == {0, 1, 2}
    res = asyncio.run(
        drive("http://bench.test", wl.requests, concurrency=3, deadline_s=30, transport=httpx.MockTransport(handler))
    )
    for req, rec in zip(wl.requests, res.outcomes):
        kind = req.prompt[0] % 3
        assert not rec.ok and rec.request is req
        if kind == 0:
            assert (rec.end, rec.http_status, rec.message) == (End.HTTP_ERROR, 500, "boom")
            assert rec.reason == "HTTP 500: boom" and "boom" in rec.body
        elif kind == 1:
            assert (rec.end, rec.reason) == (End.ABORT, "bad prompt")
        else:
            assert (rec.end, rec.reason) == (End.CUT, "expected 3 output tokens, got 2")


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
    assert [grouped.prefix_group(r.index) for r in grouped.requests] == [0, 0, 1, 1, 0, 0]
    assert grouped.requests[0].prompt[:5] == grouped.requests[4].prompt[:5]
    for bad in (dict(num_turns=0), dict(num_turns=2, turn_len=0), dict(num_turns=4, turn_len=1)):
        with pytest.raises(ValueError):
            WorkloadConfig(parse_lengths("8"), parse_lengths("2"), 6, vocab_size=50, **bad)


def test_multi_turn_resends_the_conversation_closed_loop() -> None:
    """A follow-up is sent after its previous turn finished, with that turn's prompt + its output
    ids + its own new tokens; a failed turn fails its follow-ups unsent; cached_tokens recorded."""
    wl = _multi_turn(n=6, turns=3)
    sent: list[list[int]] = []
    fail_first = wl.requests[3].prompt  # the second conversation's first turn fails

    def handler(request: httpx.Request) -> httpx.Response:
        ids = json.loads(request.content)["input_ids"]
        sent.append(ids)
        if ids == list(fail_first):
            return httpx.Response(500, json={"error": {"message": "boom"}})
        out = [len(ids), len(ids) + 1]  # the "model" answers with the prompt length
        evs = [
            {
                "output_ids": out[:i],
                "meta_info": {
                    "completion_tokens": i,
                    "cached_tokens": 16 * (i - 1),
                    "finish_reason": {"type": "length"} if i == 2 else None,
                },
            }
            for i in (1, 2)
        ]
        return httpx.Response(200, content=sse(*evs, b"[DONE]"), headers={"content-type": "text/event-stream"})

    res = asyncio.run(
        drive("http://bench.test", wl.requests, concurrency=2, deadline_s=30, transport=httpx.MockTransport(handler))
    )
    t0, t1, t2 = (list(wl.requests[i].prompt) for i in range(3))
    turn1 = t0 + [8, 9] + t1
    assert sent.count(t0) == 1 and turn1 in sent and turn1 + [14, 15] + t2 in sent
    assert sent.index(turn1) > sent.index(t0)
    recs = res.outcomes
    assert [r.ok for r in recs] == [True, True, True, False, False, False]
    assert [r.prompt_len for r in recs[:3]] == [8, 14, 20] and recs[2].cached_tokens == 16
    assert [r.end for r in recs[4:]] == [End.NOT_SENT] * 2 and recs[4].latency_s is None
    assert "request 3" in recs[4].reason and "request 4" in recs[5].reason  # never sent
    assert len(sent) == 4
    s = summarize(recs, 1.0)
    assert s["cached_tokens_mean"] == 16.0 and s["prompt_tokens_mean"] == 14.0


# ---- one request of every API, streamed or not ------------------------------------------------------
def _req(stream: bool, disconnect_after: int | None = None, api: Api = Api.GENERATE) -> Request:
    return Request(0, (5, 6, 7) if api is Api.GENERATE else "abc", 4, api, stream, disconnect_after=disconnect_after)


def _native(n: int, total: int = 4) -> list[dict]:
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


def send_one(req: Request, response: httpx.Response, deadline_s: float = 5.0) -> Outcome:
    """`send` against a transport that answers `response` to anything."""

    async def go() -> Outcome:
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://x", req, deadline_s, model="m")

    return asyncio.run(go())


def test_send_ends() -> None:
    ok = send_one(_req(False), httpx.Response(200, json=_native(4)[-1]))
    assert ok.end is End.OK and ok.http_status == 200 and ok.latency_s is not None and ok.output_tokens == 4
    streamed = send_one(_req(True), httpx.Response(200, stream=_Body([sse(*_native(4), b"[DONE]")])))
    assert streamed.end is End.OK and streamed.events == 4, streamed.reason
    err = send_one(_req(False), httpx.Response(500, json={"error": {"message": "KV transfer failed"}}))
    assert (err.end, err.http_status, err.message) == (End.HTTP_ERROR, 500, "KV transfer failed")
    assert err.reason == "HTTP 500: KV transfer failed"
    bare = send_one(_req(False), httpx.Response(502, content=b""))
    assert (bare.end, bare.message, bare.reason) == (End.HTTP_ERROR, "", "HTTP 502: (no message)")
    cut = send_one(_req(True), httpx.Response(200, stream=_Body([sse(*_native(4)[:3])])))
    assert cut.end is End.CUT and "without [DONE]" in cut.reason
    early = send_one(_req(True), httpx.Response(200, stream=_Body([sse(*_native(2), b"[DONE]")])))
    assert early.end is End.CUT and "finish reason" in early.reason
    short = send_one(_req(False), httpx.Response(200, json=_native(3, total=3)[-1]))
    assert (short.end, short.reason) == (End.CUT, "expected 4 output tokens, got 3")
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "KV transfer failed"}}}
    ab = send_one(_req(True), httpx.Response(200, stream=_Body([sse(aborted, b"[DONE]")])))
    assert (ab.end, ab.message, ab.reason) == (End.ABORT, "KV transfer failed", "aborted: KV transfer failed")
    bad = send_one(_req(True), httpx.Response(200, stream=_Body([b"data: {broken\n\n"])))
    assert bad.end is End.CUT and "malformed" in bad.reason


def test_only_events_with_new_tokens_are_stamped() -> None:
    events = [_native(1)[0], _native(1)[0], *_native(4)[1:]]  # the second brings no new token
    r = send_one(_req(True), httpx.Response(200, stream=_Body([sse(*events, b"[DONE]")])))
    assert r.end is End.OK and r.events == 5 and r.token_counts == (1, 2, 3, 4) and len(r.token_times) == 4


def test_send_disconnects_after_k_events() -> None:
    body = _Body([sse(*_native(3, total=64))], hang=True)  # the server would go on for long
    r = send_one(_req(True, disconnect_after=2), httpx.Response(200, stream=body))
    assert r.end is End.DISCONNECTED and r.reason == "closed by us after 2 events" and r.events == 2
    assert body.closed


def test_stalled_stream_times_out() -> None:
    body = _Body([sse(*_native(1))], hang=True)
    r = send_one(_req(True), httpx.Response(200, stream=body), deadline_s=0.3)
    assert r.end is End.TIMEOUT and "0.3 s" in r.reason and r.events == 1


def test_refused_connection() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async def go() -> Outcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await send(client, "http://x", _req(True), 5.0)

    r = asyncio.run(go())
    assert r.end is End.CONNECTION and r.http_status is None and "refused" in r.reason


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETION])
def test_openai_stream_with_usage(api: Api) -> None:
    def piece(text: str) -> dict:
        return {"delta": {"content": text}} if api is Api.CHAT else {"text": text}

    chunks = [
        {"choices": [{"delta": {"role": "assistant"}} if api is Api.CHAT else {"text": ""}]},  # no text yet
        {"choices": [{**piece("x"), "finish_reason": None}]},
        {"choices": [{**piece("y"), "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 4}},
    ]
    r = send_one(_req(True, api=api), httpx.Response(200, stream=_Body([sse(*chunks, b"[DONE]")])))
    assert r.end is End.OK, r.reason
    # each chunk with text stamps one token (TTFT at the first), the usage the exact total
    assert r.token_counts == (1, 2, 4) and len(r.token_times) == 3, r.token_counts
    short = [*chunks[:3], {"choices": [], "usage": {"completion_tokens": 2}}]
    r = send_one(_req(True, api=api), httpx.Response(200, stream=_Body([sse(*short, b"[DONE]")])))
    assert r.end is End.CUT and "expected 4" in r.reason


def test_bodies_per_api() -> None:
    gen = Request(0, (1, 2), 3).body()
    assert gen == {
        "input_ids": [1, 2],
        "stream": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    }
    assert "text" in Request(0, "hi", 3, stream=False).body()
    chat = Request(0, "hi", 3, Api.CHAT).body("m")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["model"] == "m"
    assert chat["stream_options"] == {"include_usage": True}
    assert Request(0, "hi", 3, Api.COMPLETION, stream=False).body("m")["prompt"] == "hi"
    with pytest.raises(ValueError):
        Request(0, (1, 2), 3, Api.CHAT).body("m")
