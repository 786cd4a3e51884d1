"""Async load generator: sends a workload to a streaming `/generate` endpoint and records when
each stream event arrived.

Requests are released at their arrival offsets and at most `concurrency` are in flight (a
semaphore); the clock of a request starts when it is actually sent. Every request has an overall
deadline besides httpx's per-read timeout, so a stuck stream fails that request, not the run.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from kvpipe.bench.metrics import RequestRecord
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


async def _stream_one(client: httpx.AsyncClient, url: str, req: BenchRequest, rec: RequestRecord,
                      clock: Callable[[], float]) -> None:
    async with client.stream("POST", url, json=req.body(stream=True)) as resp:
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
    rec.end_s = clock()
    if rec.output_tokens != req.output_len and rec.error is None:
        rec.error = f"expected {req.output_len} output tokens, got {rec.output_tokens}"


async def drive(url: str, workload: Workload, concurrency: int, timeout_s: float, progress: bool = True,
                desc: str = "requests", transport: httpx.AsyncBaseTransport | None = None,
                clock: Callable[[], float] = time.perf_counter) -> RunResult:
    """Run every request of `workload` against `url` (the full `/generate` URL)."""
    from tqdm import tqdm

    if concurrency < 1 or timeout_s <= 0:
        raise ValueError(f"concurrency must be >= 1 and timeout > 0, got {concurrency}, {timeout_s}")
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    records = [RequestRecord(r.index, r.prompt_len, 0.0) for r in workload.requests]
    bar = tqdm(total=len(records), desc=desc, disable=not progress, file=sys.stderr, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport) as client:
        t0 = clock()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - clock()))
            async with sem:
                rec.start_s = clock()
                try:
                    await asyncio.wait_for(_stream_one(client, url, req, rec, clock), timeout_s)
                except asyncio.TimeoutError:
                    rec.error = f"timed out after {timeout_s:g} s"
                except (httpx.HTTPError, ValueError) as e:  # ValueError: a malformed event
                    rec.error = f"{type(e).__name__}: {e}"
            bar.update(1)

        try:
            await asyncio.gather(*(one(q, r) for q, r in zip(workload.requests, records)))
        finally:
            bar.close()
        duration = clock() - t0
    return RunResult(records, max(duration, 1e-9))


def run_workload(url: str, workload: Workload, concurrency: int = 1, timeout_s: float = 300.0,
                 progress: bool = True, desc: str = "requests") -> RunResult:
    """Synchronous wrapper; `url` is the server root (…:port), `/generate` is appended."""
    return asyncio.run(drive(url.rstrip("/") + "/generate", workload, concurrency, timeout_s, progress, desc))
