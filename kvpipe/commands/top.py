"""`kvpipe top`: a live terminal view of a running stack, through its router's worker list.

    kvpipe top                                   # the router of `kvpipe launch` / `make run`
    kvpipe top --url http://127.0.0.1:8000 --interval 2
    kvpipe top --once                            # one frame (two readings --interval apart), then exit
    kvpipe top --workers http://127.0.0.1:30000  # servers without a router (e.g. colocated)

Every --interval seconds it asks the router for its workers (server/router_workers.py; a --url
that is a server, not a router, is shown alone), reads each worker's `/metrics` (open without
--api-key, as in SGLang) and redraws in place (rich.live): per worker its role, uptime and the
restarts seen meanwhile (a new `kvpipe_server_start_time_seconds`), requests and tokens per
second, TTFT p50 / p99, inter-token latency, running / waiting requests, KV pages and state /
staging slots in use, KV transfer GB/s; below, the TTFT components (mean and p99 over the
interval) by role. Figures are over the last interval (top_stats.py); docs/metrics.md says what
each metric measures.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvpipe.commands.top_stats import COMPONENTS, Latency, Scrape, WorkerView, parse_metrics, worker_view
from kvpipe.server.client_keys import client_headers
from kvpipe.server.router_workers import Worker, workers_or_self

DEFAULT_URL = "http://127.0.0.1:8000"  # `kvpipe launch` / `make run`'s router (as `kvpipe chat`)


class Poller:
    """Reads the workers' /metrics and keeps each one's previous reading and restart count."""

    def __init__(self, client: httpx.Client, router: str | None, workers: list[str]) -> None:
        self.client, self.router, self.fixed = client, router, [Worker(u) for u in workers]
        self.prev: dict[str, Scrape] = {}
        self.started: dict[str, float] = {}  # url -> the start time last seen
        self.restarts: dict[str, int] = {}
        self.router_error: str | None = None

    def workers(self) -> list[Worker]:
        if self.router is None:
            return self.fixed
        try:
            found = workers_or_self(self.client, self.router)
            self.router_error = None
            return found
        except (httpx.HTTPError, ValueError) as e:
            self.router_error = f"router {self.router}: {type(e).__name__}: {e}"
            return [Worker(u) for u in self.prev]  # the last known ones

    def poll(self) -> list[WorkerView]:
        views = []
        for w in self.workers():
            try:
                r = self.client.get(w.url.rstrip("/") + "/metrics")
                r.raise_for_status()
                cur = parse_metrics(r.text, time.monotonic())
            except (httpx.HTTPError, ValueError) as e:
                views.append(WorkerView(w.url, w.role or "?", up=False, healthy=w.healthy, error=type(e).__name__))
                continue
            started = cur.value("kvpipe_server_start_time_seconds")
            seen = self.started.get(w.url)
            if started is not None:
                if seen is not None and started != seen:
                    self.restarts[w.url] = self.restarts.get(w.url, 0) + 1
                self.started[w.url] = started
            views.append(
                worker_view(
                    w.url, cur, self.prev.get(w.url), w.role, w.healthy, self.restarts.get(w.url, 0), time.time()
                )
            )
            self.prev[w.url] = cur
        return views


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _of(used: float | None, total: float | None) -> str:
    return "-" if used is None or total is None else f"{used:.0f}/{total:.0f}"


def _uptime(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def workers_table(views: list[WorkerView]) -> Table:
    t = Table(title="workers", title_justify="left", expand=False)
    for col in (
        "role",
        "url",
        "up",
        "restarts",
        "req/s",
        "tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "run/wait",
        "pages",
        "slots",
        "KV GB/s",
    ):
        t.add_column(col, justify="left" if col in ("role", "url") else "right", no_wrap=True)
    for v in sorted(views, key=lambda v: (v.role, v.url)):
        if not v.up:
            t.add_row(v.role, v.url, Text("DOWN", style="bold red"), str(v.restarts), *["-"] * 8, v.error or "")
            continue
        slots = _of(v.state_slots_used, v.state_slots_total)
        if v.staging_slots is not None:
            slots = f"{slots} stg {v.staging_slots:.0f}" if slots != "-" else f"stg {v.staging_slots:.0f}"
        t.add_row(
            v.role + ("" if v.healthy is not False else " (unhealthy)"),
            v.url,
            _uptime(v.uptime_s),
            Text(str(v.restarts), style="bold red" if v.restarts else ""),
            _f(v.requests_per_s, "{:.2f}"),
            _f(v.tokens_per_s),
            _ms(v.ttft.p50),
            _ms(v.ttft.p99),
            _ms(v.itl.p50),
            f"{_f(v.running, '{:.0f}')}/{_f(v.waiting, '{:.0f}')}",
            _of(v.pages_used, v.pages_total),
            slots,
            _f(v.transfer_gb_per_s, "{:.3g}"),
        )
    return t


def components_table(views: list[WorkerView]) -> Table:
    """TTFT components by role: mean and p99 (ms) of the requests that finished in the interval."""
    t = Table(title="TTFT components (ms, mean / p99)", title_justify="left", expand=False)
    t.add_column("role", no_wrap=True)
    shown = [label for label, _ in COMPONENTS if any(label in v.components for v in views)]
    for label in shown:
        t.add_column(label, justify="right", no_wrap=True)
    for v in sorted(views, key=lambda v: (v.role, v.url)):
        if not v.up or not v.components:
            continue
        cells = []
        for label in shown:
            c = v.components.get(label, Latency())
            cells.append("-" if c.mean is None else f"{_ms(c.mean)} / {_ms(c.p99)}")
        t.add_row(v.role, *cells)
    return t


def frame(views: list[WorkerView], source: str, interval_s: float, note: str | None = None) -> Group:
    up = sum(v.up for v in views)
    head = Text.assemble(
        ("kvpipe top", "bold"),
        f"  {source}  workers {up}/{len(views)} up  every {interval_s:g}s  {time.strftime('%H:%M:%S')}",
    )
    comps = components_table(views)
    if comps.row_count:
        parts: list = [head, workers_table(views), comps]
    else:  # an empty table would squeeze its title into one column
        parts = [head, workers_table(views), Text("TTFT components: no request finished in the last interval")]
    if note:
        parts.append(Text(note, style="red"))
    return Group(*parts)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the stack's router (default {DEFAULT_URL})")
    p.add_argument(
        "--workers",
        default=None,
        help="comma-separated server URLs to show instead of asking a router (e.g. a colocated server)",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between readings (rates are over it)")
    p.add_argument("--once", action="store_true", help="print one frame (two readings --interval apart) and exit")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")


def frames(poller: Poller, interval_s: float) -> Iterator[list[WorkerView]]:
    """Views every `interval_s` (the first reading only primes the rates)."""
    poller.poll()
    while True:
        time.sleep(interval_s)
        yield poller.poll()


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    if args.interval <= 0:
        raise SystemExit("kvpipe top: --interval must be > 0")
    workers = [u.strip() for u in args.workers.split(",") if u.strip()] if args.workers else []
    source = f"workers {', '.join(workers)}" if workers else f"router {args.url}"
    console = Console()
    # the admin key: the router lists its workers to its control plane's admins only
    keys = client_headers(url=workers[0] if workers else args.url, admin=True)
    with httpx.Client(timeout=args.timeout, headers=keys) as client:
        poller = Poller(client, None if workers else args.url, workers)
        if args.once:
            views = next(frames(poller, args.interval))
            console.print(frame(views, source, args.interval, poller.router_error))
            return 0 if views and all(v.up for v in views) else 1
        try:
            first = frame([], source, args.interval, "first reading...")
            with Live(first, console=console, auto_refresh=False) as live:
                for views in frames(poller, args.interval):
                    live.update(frame(views, source, args.interval, poller.router_error), refresh=True)
        except KeyboardInterrupt:
            return 0
    return 0
