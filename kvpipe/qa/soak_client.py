"""Sends the soak's planned requests (httpx, asyncio) and turns each answer into a RequestResult.

Plain httpx rather than the openai client for every kind: the soak needs the HTTP status and
body of a failure as the server sent them, and must close a stream after exactly k events
(leaving `client.stream(...)` before the body ends closes the connection). The `judge_*`
functions are pure: what a response body or one stream event means.

Each request runs under its own deadline (asyncio.wait_for, httpx's own timeouts set longer), so
a request that neither finishes nor fails is caught as a HANG, not as a client timeout error.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvpipe.bench.client import DONE, parse_sse_line
from kvpipe.qa.soak_book import Outcome, RequestResult
from kvpipe.qa.soak_plan import Kind, PlannedRequest


@dataclass(frozen=True)
class Verdict:
    """What one body or event says: still running (outcome None) or final."""

    outcome: Outcome | None
    message: str = ""
    tokens: int | None = None  # cumulative output tokens when it says


RUNNING = Verdict(None)


def error_message(body: str) -> str:
    """The message of an error body: OpenAI/SGLang {"error": {"message"}}, {"detail"}, or the text."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message") or "").strip()
        if err is not None:
            return str(err).strip()
        if "message" in obj:
            return str(obj["message"]).strip()
    return body.strip()[:300]


def judge_http_error(status: int, body: str) -> Verdict:
    msg = error_message(body)
    return Verdict(Outcome.ERROR if msg else Outcome.UNCLEAR, f"HTTP {status}: {msg or '(no message)'}")


def _finish(kind: Kind, obj: dict) -> tuple[str | None, str]:
    """(finish type, its message) of a body or event; type None while running."""
    if kind is Kind.GENERATE:
        fin = (obj.get("meta_info") or {}).get("finish_reason")
        if isinstance(fin, dict):
            return fin.get("type"), str(fin.get("message") or "")
        return fin, ""
    choices = obj.get("choices") or []
    # an OpenAI "abort" carries no reason (the server answers a failure with an error response or
    # event instead, as SGLang does): judged unclear, so the soak fails if a client ever sees one
    return (choices[0].get("finish_reason") if choices else None), ""


def _tokens(kind: Kind, obj: dict) -> int | None:
    if kind is Kind.GENERATE:
        n = (obj.get("meta_info") or {}).get("completion_tokens")
        return n if isinstance(n, int) else None
    usage = obj.get("usage") or {}
    n = usage.get("completion_tokens")
    return n if isinstance(n, int) else None


def judge_object(kind: Kind, obj: Any, want_tokens: int, final: bool) -> Verdict:
    """A non-streamed body (`final`) or one stream event."""
    if not isinstance(obj, dict):
        return Verdict(Outcome.UNCLEAR, f"not a JSON object: {str(obj)[:100]}")
    if obj.get("error") is not None:
        msg = error_message(json.dumps(obj))
        return Verdict(Outcome.ERROR if msg else Outcome.UNCLEAR, msg or "error event without a message")
    fin, msg = _finish(kind, obj)
    tokens = _tokens(kind, obj)
    if fin == "abort":
        return Verdict(
            Outcome.ERROR if msg else Outcome.UNCLEAR,
            f"aborted: {msg}" if msg else "finish_reason abort without a message",
            tokens,
        )
    if fin is None:
        return (
            Verdict(Outcome.UNCLEAR, "no finish_reason in the response", tokens) if final else Verdict(None, "", tokens)
        )
    return _with_tokens(Verdict(Outcome.SUCCESS, "", tokens), want_tokens) if final else Verdict(None, "", tokens)


def _with_tokens(v: Verdict, want: int) -> Verdict:
    if v.outcome is Outcome.SUCCESS and v.tokens is not None and v.tokens != want:
        return Verdict(Outcome.UNCLEAR, f"expected {want} output tokens, got {v.tokens}", v.tokens)
    return v


async def _plain(client: httpx.AsyncClient, url: str, req: PlannedRequest, model: str) -> tuple[int, Verdict]:
    r = await client.post(url, json=req.body(model))
    if r.status_code != 200:
        return r.status_code, judge_http_error(r.status_code, r.text)
    try:
        obj = r.json()
    except ValueError:
        return 200, Verdict(Outcome.UNCLEAR, f"malformed JSON body: {r.text[:100]}")
    return 200, judge_object(req.kind, obj, req.output_len, final=True)


async def _streamed(client: httpx.AsyncClient, url: str, req: PlannedRequest, model: str) -> tuple[int, Verdict]:
    async with client.stream("POST", url, json=req.body(model)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            return resp.status_code, judge_http_error(resp.status_code, body)
        events, finished, tokens = 0, None, None
        async for line in resp.aiter_lines():
            try:
                ev = parse_sse_line(line)
            except ValueError:
                return 200, Verdict(Outcome.UNCLEAR, f"malformed event: {line[:100]}")
            if ev is None:
                continue
            if ev is DONE:
                if finished is None:
                    return 200, Verdict(Outcome.UNCLEAR, "[DONE] before a finish_reason")
                n = tokens if tokens is not None else finished.tokens
                return 200, _with_tokens(Verdict(Outcome.SUCCESS, "", n), req.output_len)
            events += 1
            v = judge_object(req.kind, ev, req.output_len, final=False)
            if v.outcome is not None:
                return 200, v  # an error event or an abort ends the request
            tokens = v.tokens if v.tokens is not None else tokens
            fin, _ = _finish(req.kind, ev)
            if fin is not None:
                finished = v
            if req.disconnect_after is not None and events >= req.disconnect_after and finished is None:
                return 200, Verdict(Outcome.DISCONNECTED, f"closed by us after {events} events")
        return 200, Verdict(Outcome.UNCLEAR, "the stream ended without [DONE]")


async def run_one(
    client: httpx.AsyncClient,
    base_url: str,
    req: PlannedRequest,
    model: str,
    deadline_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> RequestResult:
    url = base_url.rstrip("/") + req.kind.path
    send = _streamed if req.stream else _plain
    t0 = clock()
    status: int | None = None
    try:
        status, v = await asyncio.wait_for(send(client, url, req, model), deadline_s)
    except asyncio.TimeoutError:
        v = Verdict(Outcome.HANG, f"no final status after {deadline_s:g} s")
    except httpx.HTTPError as e:  # a dropped connection or a protocol error: no status, no message
        v = Verdict(Outcome.UNCLEAR, f"{type(e).__name__}: {e}")
    return RequestResult(
        req.index, req.kind, req.stream, req.prompt_len, v.outcome or Outcome.UNCLEAR, clock() - t0, status, v.message
    )


async def drive(
    base_url: str,
    requests: list[PlannedRequest],
    model: str,
    concurrency: int,
    deadline_s: float,
    on_result: Callable[[RequestResult], None],
    progress: bool = True,
    desc: str = "soak",
) -> None:
    """Every request, at most `concurrency` in flight; `on_result` gets each final result."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    # httpx's own timeouts stay out of the way of the per-request deadline
    timeout = httpx.Timeout(deadline_s + 30.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, file=sys.stderr, leave=False)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(req: PlannedRequest) -> None:
            async with sem:
                res = await run_one(client, base_url, req, model, deadline_s)
            on_result(res)
            bar.update(1)

        try:
            await asyncio.gather(*(one(r) for r in requests))
        finally:
            bar.close()
