"""Async load generator: sends a workload to a streaming `/generate` endpoint and records when
each stream event arrived.

Requests are released at their arrival offsets and at most `concurrency` are in flight (a
semaphore); the clock of a request starts when it is actually sent. A multi-turn follow-up
(`BenchRequest.follows`) is sent once the turn it follows finished, with the whole conversation:
that turn's prompt, its output ids, then the follow-up's new tokens (closed loop, as a chat
client resends the conversation); if that turn failed, the follow-up fails unsent. Every request has an overall
deadline besides httpx's per-read timeout, so a stuck stream fails that request, not the run.
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

from kvpipe.bench.latency import RequestRecord
from kvpipe.bench.workload import BenchRequest, Workload

DONE = object()  # the `data: [DONE]` sentinel


def parse_sse_line(line: str) -> Any:
    """One SSE line -> the event's JSON object, DONE, or None (blank lines, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    return json.loads(payload) if payload else None


def event_tokens(event: dict) -> int:
    """Cumulative output tokens so far: meta_info.completion_tokens, else len(output_ids)."""
    meta = event.get("meta_info") or {}
    n = meta.get("completion_tokens")
    if isinstance(n, int):
        return n
    return len(event.get("output_ids") or [])


def event_error(event: dict) -> str | None:
    """An error event ({"error": ...}) or an aborted finish -> a message; None when fine."""
    err = event.get("error")
    if err is not None:
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    finish = (event.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"aborted: {finish.get('message', '')}".rstrip(": ")
    return None


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first send -> last request finished


async def _stream_one(
    client: httpx.AsyncClient,
    url: str,
    req: BenchRequest,
    rec: RequestRecord,
    clock: Callable[[], float],
    input_ids: list[int],
    output_ids: list[int],
) -> None:
    """Stream one request; `output_ids` receives the final cumulative output ids."""
    async with client.stream("POST", url, json=req.body(stream=True, input_ids=input_ids)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {body[:300]}"
            return
        async for line in resp.aiter_lines():
            ev = parse_sse_line(line)
            if ev is None:
                continue
            if ev is DONE:
                break
            err = event_error(ev)
            if err:
                rec.error = err
                return
            rec.add_event(clock(), event_tokens(ev))
            output_ids[:] = ev.get("output_ids") or output_ids
            cached = (ev.get("meta_info") or {}).get("cached_tokens")
            if isinstance(cached, int):
                rec.cached_tokens = cached
    rec.end_s = clock()
    if rec.output_tokens != req.output_len and rec.error is None:
        rec.error = f"expected {req.output_len} output tokens, got {rec.output_tokens}"


async def drive(
    url: str,
    workload: Workload,
    concurrency: int,
    timeout_s: float,
    progress: bool = True,
    desc: str = "requests",
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RunResult:
    """Run every request of `workload` against `url` (the full `/generate` URL)."""
    from tqdm import tqdm

    if concurrency < 1 or timeout_s <= 0:
        raise ValueError(f"concurrency must be >= 1 and timeout > 0, got {concurrency}, {timeout_s}")
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    records = [RequestRecord(r.index, r.prompt_len, 0.0) for r in workload.requests]
    by_index = {r.index: i for i, r in enumerate(workload.requests)}
    for r in workload.requests:
        if r.follows is not None and r.follows not in by_index:
            raise ValueError(f"request {r.index} follows request {r.follows}, which is not in the workload")
    done = [asyncio.Event() for _ in records]
    prompts: list[list[int]] = [[] for _ in records]  # what each request sent
    outputs: list[list[int]] = [[] for _ in records]  # its final output ids
    bar = tqdm(total=len(records), desc=desc, disable=not progress, file=sys.stderr, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport) as client:
        t0 = clock()

        async def one(k: int, req: BenchRequest, rec: RequestRecord) -> None:
            try:
                await asyncio.sleep(max(0.0, t0 + req.arrival_s - clock()))
                ids = list(req.input_ids)
                if req.follows is not None:
                    prev = by_index[req.follows]
                    await done[prev].wait()
                    if not records[prev].ok:
                        rec.error = f"not sent: the turn it follows (request {req.follows}) failed"
                        return
                    ids = prompts[prev] + outputs[prev] + ids
                prompts[k], rec.prompt_len = ids, len(ids)
                async with sem:
                    rec.start_s = clock()
                    try:
                        await asyncio.wait_for(_stream_one(client, url, req, rec, clock, ids, outputs[k]), timeout_s)
                    except asyncio.TimeoutError:
                        rec.error = f"timed out after {timeout_s:g} s"
                    except (httpx.HTTPError, ValueError) as e:  # ValueError: a malformed event
                        rec.error = f"{type(e).__name__}: {e}"
            finally:
                done[k].set()
                bar.update(1)

        try:
            await asyncio.gather(*(one(k, q, r) for k, (q, r) in enumerate(zip(workload.requests, records))))
        finally:
            bar.close()
        duration = clock() - t0
    return RunResult(records, max(duration, 1e-9))


def run_workload(
    url: str,
    workload: Workload,
    concurrency: int = 1,
    timeout_s: float = 300.0,
    progress: bool = True,
    desc: str = "requests",
) -> RunResult:
    """Synchronous wrapper; `url` is the server root (…:port), `/generate` is appended."""
    return asyncio.run(drive(url.rstrip("/") + "/generate", workload, concurrency, timeout_s, progress, desc))
