"""`kvpipe top`'s arithmetic (kvpipe/commands/top_stats.py) on real /metrics texts (ServerMetrics
of each role): rates over an interval, Prometheus-style quantiles of what finished in it, a
restarted server, the router's worker list, and one rendered frame."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvpipe.commands.top import frame
from kvpipe.commands.top_stats import Hist, Scrape, WorkerView, parse_metrics, worker_view
from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.router_workers import role_of

PREFILL_STATS = {"num_running": 2, "num_waiting": 1, "free_pages": 30, "total_pages": 100}


def decode_timeline(t0: float, kv_wait: float) -> Timeline:
    tl = Timeline()
    for phase, t in [(Phase.ARRIVED, t0), (Phase.PAGES_RESERVED, t0 + 0.25), (Phase.KV_ARRIVED, t0 + 0.25 + kv_wait)]:
        tl.mark(phase, t)
    tl.mark(Phase.FINISHED, t0 + 2.0)
    return tl


def test_hist_quantile_is_prometheus_histogram_quantile() -> None:
    h = Hist(((0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 8.0)), 3.0, 8.0)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)  # rank 4 in (0.1, 0.5]
    assert h.quantile(0.25) == pytest.approx(0.1)
    assert h.quantile(1.0) == 1.0 and h.mean() == 3.0 / 8
    beyond = Hist(((1.0, 1.0), (float("inf"), 3.0)), 9.0, 3.0)
    assert beyond.quantile(0.99) == 1.0  # in +Inf: the highest finite bound
    assert Hist(((1.0, 0.0), (float("inf"), 0.0)), 0.0, 0.0).quantile(0.5) is None
    older = Hist(((0.1, 1.0), (0.5, 2.0), (1.0, 2.0), (float("inf"), 2.0)), 0.5, 2.0)
    assert h.minus(older) == Hist(((0.1, 1.0), (0.5, 4.0), (1.0, 6.0), (float("inf"), 6.0)), 2.5, 6.0)
    assert h.minus(Hist(h.buckets, 9.0, 99.0)) == h  # counts went down: a restarted server, all of it


def test_rates_and_latencies_over_the_interval() -> None:
    stats = {**PREFILL_STATS, "disaggregation": {"bytes_written": 1000}}  # read at each scrape
    m = ServerMetrics("tiny", lambda: stats, "prefill")
    m.on_first_token(5.0)  # before the interval: not in its quantiles
    m.on_finish("length", 100, 0, 1, 5.0, 5.0)
    first = parse_metrics(m.render().decode(), at=10.0)
    for _ in range(4):
        m.on_first_token(0.2)
        m.on_finish("length", 50, 0, 1, 0.3, 0.2)
    stats["disaggregation"] = {"bytes_written": 1000 + 4 * 10**9}
    second = parse_metrics(m.render().decode(), at=12.0)
    v = worker_view("http://p", second, first, None, True)
    assert v.role == "prefill" and v.interval_s == 2.0  # from the metrics' role label
    assert v.requests_per_s == 2.0 and v.prompt_tokens_per_s == 100.0 and v.tokens_per_s == 2.0
    assert v.transfer_gb_per_s == pytest.approx(2.0)
    assert v.ttft.p50 is not None and v.ttft.p99 is not None
    assert 0.1 < v.ttft.p50 <= 0.25 and v.ttft.p99 <= 0.25  # the interval's four, not the 5 s one
    assert (v.running, v.waiting, v.pages_used, v.pages_total) == (2, 1, 70, 100)
    started = second.values["kvpipe_server_start_time_seconds"]
    since_start = worker_view("http://p", second, None, None, wall_now=started + 10)
    assert since_start.requests_per_s == pytest.approx(0.5) and since_start.interval_s is None  # 5 in 10 s


def test_components_restart_and_the_rendered_frame() -> None:
    m = ServerMetrics("tiny", lambda: {"free_pages": 5, "total_pages": 10}, "decode")
    before = parse_metrics(m.render().decode(), at=0.0)
    for kv_wait in (0.5, 0.75):
        rec = decode_timeline(100.0, kv_wait).record()
        assert rec is not None
        m.on_timeline(rec)
    m.on_tokens(0.04, 2)
    after = parse_metrics(m.render().decode(), at=1.0)
    v = worker_view("http://d", after, before, "decode", None, restarts=1)
    assert set(v.components) == {"decode wait", "kv wait"}  # a decode's parts only
    assert v.components["kv wait"].mean == pytest.approx(0.625)
    assert v.itl.mean == pytest.approx(0.02)
    # a reading of another process (new start time): rates since its start, not against the old one
    restarted = Scrape(2.0, {**after.values, "kvpipe_server_start_time_seconds": 5.0}, after.hists, after.roles)
    again = worker_view("http://d", restarted, after, "decode", wall_now=15.0)
    assert again.interval_s is None and again.uptime_s == 10.0
    console = Console(record=True, width=230)
    console.print(frame([v, worker_view("http://p", after, None, "prefill")], "router http://r", 1.0))
    text = console.export_text()
    assert "http://d" in text and "http://p" in text
    assert "TTFT components of the decode servers" in text and text.split().count("wait") >= 2  # decode / kv wait


def test_router_worker_types() -> None:
    assert role_of("Prefill { bootstrap_port: Some(8998) }") == "prefill"
    assert role_of("Decode") == "decode" and role_of("Regular") == "colocated" and role_of("") is None


def test_a_server_that_finished_nothing_shows_zero_rates() -> None:
    """Its labelled counters have no sample yet: zero requests and tokens per second, not unknown;
    the components table gives way to one line."""
    m = ServerMetrics("tiny", lambda: {"num_running": 16}, "decode")
    v = worker_view("http://d", parse_metrics(m.render().decode(), 3.0), parse_metrics(m.render().decode(), 1.0))
    assert (v.requests_per_s, v.tokens_per_s, v.running, v.transfer_gb_per_s) == (0.0, 0.0, 16, None)
    console = Console(record=True, width=200)
    console.print(frame([v], "router http://r", 2.0))
    assert "no request finished in the last interval" in console.export_text()


def _scrapes(role: str, name: str, stats: dict, work: int) -> tuple[Scrape, Scrape]:
    """Two readings 2 s apart of a named server whose engine generated `work` tokens meanwhile and
    finished nothing (its requests still run)."""
    m = ServerMetrics("SmolLM2-135M-Instruct", lambda: stats, role, worker_name=name)
    first = parse_metrics(m.render().decode(), at=10.0)
    stats["generated_tokens"] += work
    return first, parse_metrics(m.render().decode(), at=12.0)


def test_decode_rows_show_the_running_requests_speed_under_their_worker_names() -> None:
    stats = {"num_running": 8, "num_waiting": 0, "free_pages": 10, "total_pages": 100, "generated_tokens": 500}
    first, second = _scrapes("decode", "decode1", stats, 96)
    v = worker_view("http://d1", second, first, "decode")
    assert v.name == v.label == "decode1" and v.role == "decode"
    assert v.tokens_per_s == 48.0 and v.requests_per_s == 0.0  # nothing finished, tokens still flow
    unnamed = ServerMetrics("m", lambda: {}, "decode")
    assert worker_view("http://d", parse_metrics(unnamed.render().decode(), 1.0)).label == "decode"


def test_the_frame_is_readable_at_80_columns_without_a_tty() -> None:
    """Every header and worker name whole (issue 47: columns cut to "r..." at 80 columns or piped),
    a 2P2D stack with large figures and one worker down."""
    views = []
    for i, (role, name) in enumerate([("prefill", "prefill0"), ("prefill", "prefill1"), ("decode", "decode0")]):
        stats = {"num_running": 128, "num_waiting": 1024, "free_pages": 1, "total_pages": 65536}
        stats |= {"generated_tokens": 10**6, "disaggregation": {"bytes_written": 10**9 * i}}
        m = ServerMetrics("SmolLM2-135M-Instruct", lambda stats=stats: stats, role, worker_name=name)  # type: ignore[misc]
        first = parse_metrics(m.render().decode(), at=10.0)
        stats["generated_tokens"] += 24_000
        m.on_first_token(12.5)
        rec = decode_timeline(100.0, 7.5).record()
        assert rec is not None
        m.on_timeline(rec)
        views.append(worker_view(f"http://127.0.0.1:3000{i}", parse_metrics(m.render().decode(), 12.0), first, role))
    views.append(WorkerView("http://127.0.0.1:30003", "decode", up=False, name="decode1", error="ConnectError"))
    console = Console(width=80, file=io.StringIO())  # what a pipe gets: rich's default width, no TTY
    assert not console.is_terminal
    console.print(frame(views, "router http://127.0.0.1:8000", 2.0))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in text and "..." not in text, text
    words = {w for line in lines for w in line.split()}
    for header in ("worker", "up", "restarts", "req/s", "tok/s", "TTFT", "p50", "p99", "ms", "ITL", "run/", "wait"):
        assert header in words, (header, text)
    for header in ("role", "url", "pages", "slots", "KV", "GB/s", "kv", "decode"):
        assert header in words, (header, text)
    for name in ("prefill0", "prefill1", "decode0", "decode1"):
        assert sum(line.split()[:1] == [name] for line in lines) >= 2, (name, text)  # in both tables
    assert "http://127.0.0.1:30003" in text and "DOWN" in text and "12000.0" in text  # 24,000 tokens in 2 s
