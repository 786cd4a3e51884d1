"""What per-request recording costs, request by request: `python -m kvpipe.bench.serve.recording_cost`.

Replays, in one process and without a model, the recording calls one request makes on each kind of
server (issue 29): the engine's timeline marks (a few per prefill chunk, the transfer stretches of
a PD prefill, none per decode token), the sorted record at the finish, the histograms fed from it,
TTFT, one inter-token observation per token after the first, and the `/debug/requests` entry
(`to_json`). The same calls with recording off (--disable-request-metrics: a disabled Timeline and
`ServerMetrics(per_request=False)`) run interleaved with them; the difference of the medians is
the cost. A serving benchmark at concurrency 16 on this shared machine cannot resolve 1% of
throughput reliably; this number, against a request's time, can (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvpipe.disagg.timeline_events import record_transfer
from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.server.metrics import ServerMetrics
from kvpipe.transfer.sender.stats import TransferTiming

ROLES = ("colocated", "prefill", "decode")


def one_request(role: str, metrics: ServerMetrics, recent: deque, enabled: bool, chunks: int, tokens: int) -> None:
    """The recording calls of one request on a `role` server, in the order the server makes them."""
    tl = Timeline(enabled=enabled)
    tl.mark(Phase.ARRIVED)
    if role == "decode":
        tl.mark(Phase.PAGES_RESERVED)
        tl.mark(Phase.KV_ARRIVED)
        tl.mark(Phase.FIRST_TOKEN)
    else:
        for c in range(chunks):
            if not tl.has(Phase.SCHEDULED):
                tl.mark(Phase.SCHEDULED)
            tl.mark(Phase.FORWARD_START, value=256)
            if role == "prefill":
                tl.mark(Phase.LAYER_GROUP_DONE, value=c)
            tl.mark(Phase.FORWARD_END, value=256)
        tl.mark(Phase.FIRST_TOKEN)
    metrics.on_first_token(0.05)
    emitted = 1 if role == "prefill" else tokens
    for _ in range(emitted - 1):  # one stream update per decode step
        metrics.on_tokens(0.02, 1)
    tl.mark(Phase.FINISHED)
    if role == "prefill":
        now = time.monotonic()
        spans = tuple((now + i, now + i + 0.5) for i in range(chunks))
        record_transfer(tl, TransferTiming(1, 1 << 20, 0.5 * chunks, spans[0][0], spans[-1][1], now, spans))
        tl.mark(Phase.RELEASED)
    record = tl.record()
    if record is not None:
        recent.append({"rid": "r", "bootstrap_room": None, "finish_reason": "length", "timeline": record.to_json()})
        metrics.on_timeline(record)
    metrics.on_finish("length", 512, 0, emitted, 1.0, 0.05)


def _time_batch(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(role: str, chunks: int, tokens: int, batch: int, repeats: int) -> dict[str, Any]:
    """Median seconds per request with recording on and off (batches alternate), and their difference."""
    on = ServerMetrics("bench", lambda: None, role)
    off = ServerMetrics("bench", lambda: None, role, per_request=False)
    recent_on: deque = deque(maxlen=256)
    recent_off: deque = deque(maxlen=256)

    def run_on() -> None:
        one_request(role, on, recent_on, True, chunks, tokens)

    def run_off() -> None:
        one_request(role, off, recent_off, False, chunks, tokens)

    for fn in (run_on, run_off):  # warm up
        _time_batch(fn, batch)
    t_on: list[float] = []
    t_off: list[float] = []
    for r in range(repeats):
        for fn, into in ((run_on, t_on), (run_off, t_off)) if r % 2 == 0 else ((run_off, t_off), (run_on, t_on)):
            into.append(_time_batch(fn, batch))
    on_us, off_us = statistics.median(t_on) * 1e6, statistics.median(t_off) * 1e6
    return {
        "role": role,
        "chunks": chunks,
        "output_tokens": 1 if role == "prefill" else tokens,
        "on_us": round(on_us, 2),
        "off_us": round(off_us, 2),
        "cost_us": round(on_us - off_us, 2),
        "on_us_spread": [round(min(t_on) * 1e6, 2), round(max(t_on) * 1e6, 2)],
        "off_us_spread": [round(min(t_off) * 1e6, 2), round(max(t_off) * 1e6, 2)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpipe.bench.serve.recording_cost", description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=2, help="prefill chunks (forwards) per request")
    p.add_argument("--output-tokens", type=int, default=32, help="output tokens per request (colocated, decode)")
    p.add_argument("--batch", type=int, default=500, help="requests per timed batch")
    p.add_argument("--repeats", type=int, default=21, help="timed batches per side (on / off alternate)")
    args = p.parse_args(argv)
    rows = [measure(role, args.chunks, args.output_tokens, args.batch, args.repeats) for role in ROLES]
    print(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
