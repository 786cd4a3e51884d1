"""`kvpipe top`: a live terminal view of a running stack, through its router's worker list.

    kvpipe top                                   # the router of `kvpipe launch` / `make run`
    kvpipe top --url http://127.0.0.1:8000 --interval 2
    kvpipe top --once                            # one frame (two readings --interval apart), then exit
    kvpipe top --workers http://127.0.0.1:30000  # servers without a router (e.g. colocated)

Every --interval seconds it asks the router for its workers (server/router_workers.py; a --url
that is a server, not a router, is shown alone), reads each worker's `/metrics` (open without
--api-key, as in SGLang) and redraws in place (rich.live): a row per worker, named by its
--worker-name (`kvpipe launch`'s prefill0, decode1, ...; else its role), with its uptime and the
restarts seen meanwhile (a new `kvpipe_server_start_time_seconds`), requests per second, the
tokens per second its steps generated (the running requests' speed), TTFT p50 / p99, inter-token
latency, running / waiting requests; then where each worker is (role, URL) and what it holds (KV
pages, state / staging slots, KV transfer GB/s); below, the TTFT components (mean and p99 over the
interval) per worker, a table per role. Figures are over the last interval (top_stats.py);
docs/metrics.md says what each metric measures. The tables fit 80 columns (top_tables.py), so
the view reads the same piped or in a narrow terminal.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import httpx
from rich.console import Console
from rich.live import Live

from kvpipe.commands.top_stats import Scrape, WorkerView, parse_metrics, worker_view
from kvpipe.commands.top_tables import frame
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
                last = self.prev.get(w.url)  # a worker that went down keeps the name it had
                name = last.name if last is not None else None
                views.append(
                    WorkerView(w.url, w.role or "?", up=False, name=name, healthy=w.healthy, error=type(e).__name__)
                )
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
