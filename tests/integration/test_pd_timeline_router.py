"""Request timelines through sglang-router (issue 29). sglang-router 0.3.2 forwards only the request
fields it knows, and `return_timeline` is not one of them: a request through it finds its decode
timeline at the decode's /debug/requests under its rid and its prefill timeline at the prefill's
under the same bootstrap room (a body sent to the servers directly, as the router would, gets
them in meta_info: the second test). Checks the phases' order on both sides and across
them (one host: CLOCK_MONOTONIC is shared by the servers), that the components fit in the
request's end-to-end time, and that the role-labelled histograms moved and sum to the timelines.
Last, on the same stack, `kvpipe top` read off a terminal: it runs in a detached tmux session of a
fixed size while two clients load the router, and the captured screen must show both workers with
nonzero request rates, the decode's token rate and the prefill's KV transfer rate; `--once` then
prints one frame. Every wait is bounded. Nothing here times anything."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.bench.serve.timeline_plot import DECODE, KV_TRANSFER, PREFILL_COMPUTE, request_bars, timeline_figure
from kvpipe.server.metrics import PHASE_HISTOGRAMS
from tests.helpers.pd_stack import Stack, generate, greedy, pd_body, start_stack, wait_for
from tests.helpers.server import ServerProc
from tests.helpers.tmux import Tmux, have_tmux

pytest.importorskip("mooncake.engine")

LENS = [5, 40, 100, 300]  # chunks of 64: one to five forwards per prompt
PROMPTS = [[random.Random(n).randrange(3, 290) for _ in range(n)] for n in LENS]
# meta_info and /debug/requests round each duration to 6 decimals
JSON_ROUNDING_S = 1e-6


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-timeline"),
        "--page-size",
        "16",
        "--chunked-prefill-size",
        "64",
        prefill_args=("--disaggregation-layer-groups", "2", "--disaggregation-layer-groups-min-tokens", "0"),
    )
    try:
        yield s
    finally:
        s.close()


def t(tl: dict[str, Any], phase: str, last: bool = False) -> float:
    """A phase's monotonic time (its first occurrence, or its last)."""
    ts = [e["t"] for e in tl["events"] if e["phase"] == phase]
    assert ts, (phase, [e["phase"] for e in tl["events"]])
    return tl["arrived_monotonic"] + (ts[-1] if last else ts[0])


def assert_order(tl: dict[str, Any], *phases: str) -> None:
    ts = [t(tl, p) for p in phases]
    assert ts == sorted(ts), list(zip(phases, ts))


def histograms(srv: ServerProc) -> dict[tuple[str, str], float]:
    """(sample name, role) -> value of the role-labelled _count and _sum samples in /metrics."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(srv.get("/metrics").text):
        for s in fam.samples:
            if "role" in s.labels and s.name.endswith(("_count", "_sum")):
                out[(s.name, s.labels["role"])] = s.value
    return out


def test_timelines_through_router(stack: Stack) -> None:
    def one(i: int) -> dict[str, Any]:
        body = {
            "input_ids": PROMPTS[i],
            "sampling_params": greedy(6),
            "return_timeline": True,
            "rid": f"timeline-{i}",
            "stream": i % 2 == 1,
        }
        return generate(stack.router, body)

    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(one, range(len(PROMPTS))))
    stack.prefill.wait_idle()
    stack.decode.wait_idle()
    p_debug, d_debug = stack.prefill.get("/debug/requests").json(), stack.decode.get("/debug/requests").json()
    assert p_debug["role"] == "prefill" and d_debug["role"] == "decode"
    d_by_rid = {r["rid"]: r for r in d_debug["requests"]}
    p_by_room = {r["bootstrap_room"]: r for r in p_debug["requests"]}
    assert len(p_by_room) == len(d_by_rid) == len(PROMPTS)  # only this test's requests ran on this stack

    for i, out in enumerate(outs):
        meta = out["meta_info"]
        entry = d_by_rid[f"timeline-{i}"]  # the router keeps the client's rid
        dtl = entry["timeline"]
        assert entry["finish_reason"] == "length"
        if "timeline" in meta:  # a router that forwards return_timeline
            assert meta["timeline"] == dtl
        ptl = p_by_room[entry["bootstrap_room"]]["timeline"]

        # each side's own order
        assert_order(ptl, "arrived", "scheduled", "forward_start", "first_token", "finished", "released")
        assert_order(ptl, "bootstrapped", "transfer_start", "transfer_done", "released")
        wire = [e["phase"] for e in ptl["events"] if e["phase"] in ("transfer_start", "transfer_done")]
        assert wire == ["transfer_start", "transfer_done"] * (len(wire) // 2)  # stretches, one after another
        assert t(ptl, "forward_end", last=True) <= t(ptl, "first_token")
        starts = [e for e in ptl["events"] if e["phase"] in ("forward_start", "forward_end")]
        assert all(a["t"] <= b["t"] for a, b in zip(starts, starts[1:]))  # each chunk after the one before
        assert sum(e["value"] for e in starts if e["phase"] == "forward_start") == LENS[i]
        assert any(e["phase"] == "layer_group_done" for e in ptl["events"])  # --disaggregation-layer-groups 2
        assert_order(dtl, "arrived", "pages_reserved", "kv_arrived", "first_token", "finished")

        # across the two servers: the decode hears of the KV after its last write completed
        assert t(ptl, "transfer_done", last=True) <= t(dtl, "kv_arrived")
        assert t(ptl, "first_token") <= t(dtl, "kv_arrived")

        # the components fit in the request's time on each server
        pc, dc = ptl["components"], dtl["components"]
        assert pc["queue"] + pc["prefill_compute"] + pc["exposed_transfer"] <= (
            t(ptl, "released") - t(ptl, "arrived") + 3 * JSON_ROUNDING_S
        )
        assert sum(dc.values()) == pytest.approx(t(dtl, "finished") - t(dtl, "arrived"), abs=4 * JSON_ROUNDING_S)
        # the decode's e2e_latency runs from the HTTP request (before the engine's arrival) to the answer
        assert sum(dc.values()) <= meta["e2e_latency"] + 4 * JSON_ROUNDING_S
        assert ptl["transfer_bytes"] > 0 and dtl["transfer_bytes"] is None

    # every histogram of each role moved, and sums what the timelines say
    for srv, role, timelines in (
        (stack.prefill, "prefill", [r["timeline"] for r in p_debug["requests"]]),
        (stack.decode, "decode", [r["timeline"] for r in d_debug["requests"]]),
    ):
        got = histograms(srv)
        for key, (name, _, roles) in PHASE_HISTOGRAMS.items():
            if role not in roles:
                assert (f"{name}_count", role) not in got
                continue
            want = [tl["components"][key] for tl in timelines]
            assert got[(f"{name}_count", role)] == len(PROMPTS), name
            assert got[(f"{name}_sum", role)] == pytest.approx(sum(want), abs=len(want) * JSON_ROUNDING_S), name
            assert got[(f"{name}_sum", role)] > 0, name  # not stuck at zero
        hits = got[("kvpipe_request_prefix_hit_tokens_count", role)]
        assert hits == len(PROMPTS)
    # TTFT by role on both servers; the inter-token latency on the decode only (a prefill emits
    # one token), one observation per token after each request's first
    p_hist, d_hist = histograms(stack.prefill), histograms(stack.decode)
    assert p_hist[("kvpipe_time_to_first_token_seconds_count", "prefill")] == len(PROMPTS)
    assert d_hist[("kvpipe_time_to_first_token_seconds_count", "decode")] == len(PROMPTS)
    assert d_hist[("kvpipe_inter_token_latency_seconds_count", "decode")] == sum(
        out["meta_info"]["completion_tokens"] - 1 for out in outs
    )
    assert d_hist[("kvpipe_inter_token_latency_seconds_sum", "decode")] > 0
    assert not any(name.startswith("kvpipe_inter_token_latency") for name, _ in p_hist)
    p_bytes = sum(r["timeline"]["transfer_bytes"] for r in p_debug["requests"])
    assert p_hist[("kvpipe_kv_transfer_request_bytes_sum", "prefill")] == p_bytes

    # `bench serve --timeline` from these entries: a row per request, a bar per chunk's forward,
    # per stretch of KV writes and per decode (the figure's artists)
    rows = request_bars({"prefill": p_debug["requests"], "decode": d_debug["requests"]})
    assert sorted(r.label for r in rows) == sorted(d_by_rid)
    ax = timeline_figure(rows).axes[0]
    drawn = {c.get_label(): len(c.patches) for c in ax.containers}
    ptls = [r["timeline"] for r in p_debug["requests"]]
    assert drawn == {
        PREFILL_COMPUTE: sum(e["phase"] == "forward_start" for tl in ptls for e in tl["events"]),
        KV_TRANSFER: sum(e["phase"] == "transfer_start" for tl in ptls for e in tl["events"]),
        DECODE: len(PROMPTS),
    }
    assert p_bytes == stack.prefill.engine_stats()["disaggregation"]["bytes_written"]


def test_return_timeline_in_meta_info(stack: Stack) -> None:
    """A body with return_timeline sent to both servers directly, as sglang-router sends it:
    each answers with its own timeline in meta_info, the one /debug/requests keeps."""
    body = pd_body(stack, {"input_ids": PROMPTS[2], "sampling_params": greedy(3), "return_timeline": True})
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(generate, stack.prefill.url, body)
        d = pool.submit(generate, stack.decode.url, body)
        p_out, d_out = p.result(), d.result()
    ptl, dtl = p_out["meta_info"]["timeline"], d_out["meta_info"]["timeline"]
    assert_order(ptl, "arrived", "scheduled", "first_token", "finished", "released")
    assert_order(dtl, "arrived", "pages_reserved", "kv_arrived", "finished")
    assert t(ptl, "transfer_done", last=True) <= t(dtl, "kv_arrived")
    room = body["bootstrap_room"]
    assert [
        r["timeline"] for r in stack.prefill.get("/debug/requests").json()["requests"] if r["bootstrap_room"] == room
    ] == [ptl]
    assert [
        r["timeline"] for r in stack.decode.get("/debug/requests").json()["requests"] if r["bootstrap_room"] == room
    ] == [dtl]
    # without the flag, meta_info stays as it was
    plain = pd_body(stack, {"input_ids": PROMPTS[0], "sampling_params": greedy(2)})
    with ThreadPoolExecutor(2) as pool:
        pool.submit(generate, stack.prefill.url, plain)
        assert "timeline" not in generate(stack.decode.url, plain)["meta_info"]


def top_rows(screen: str, url: str) -> tuple[list[str], list[str]] | None:
    """kvpipe top's rows of the worker at `url` (borderless tables, top_tables.py): its row of the
    workers table (name, up, restarts, req/s, tok/s, TTFT p50, TTFT p99, ITL p50, run/wait) and of
    the where table (name, role, url, pages, slots, KV GB/s), found by its URL there."""
    lines = screen.splitlines()
    where = next((ln.split() for ln in lines if url in ln.split()), None)
    if where is None or len(where) < 6:
        return None
    rate = next((ln.split() for ln in lines if ln.split()[:1] == [where[0]] and len(ln.split()) == 9), None)
    return None if rate is None else (rate, where)


def _num(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return 0.0


def shows_load(screen: str, stack: Stack) -> bool:
    p, d = top_rows(screen, stack.pd.prefill_url), top_rows(screen, stack.pd.decode_url)
    if p is None or d is None:
        return False
    (p_rate, p_where), (d_rate, d_where) = p, d
    return (p_where[1], d_where[1], p_rate[2], d_rate[2]) == ("prefill", "decode", "0", "0") and min(
        _num(p_rate[3]), _num(d_rate[3]), _num(d_rate[4]), _num(p_where[-1])
    ) > 0


@pytest.mark.skipif(not have_tmux(), reason="tmux is not installed")
def test_kvpipe_top_shows_the_stack_under_load(stack: Stack) -> None:
    stop = threading.Event()

    def load(seed: int) -> None:
        i = 0
        while not stop.is_set():
            generate(stack.router, {"input_ids": PROMPTS[(seed + i) % len(PROMPTS)], "sampling_params": greedy(8)})
            i += 1

    clients = [threading.Thread(target=load, args=(s,), daemon=True) for s in range(2)]
    term = Tmux(cols=230, rows=40)
    screen = ""
    top = [sys.executable, "-m", "kvpipe.cli", "top", "--url", stack.router, "--interval", "1"]
    try:
        term.start(top)
        for c in clients:
            c.start()

        def loaded() -> bool:
            nonlocal screen
            screen = term.screen()
            return shows_load(screen, stack)

        wait_for(loaded, 120.0, "kvpipe top to show both workers under load", interval_s=0.5)
        assert "TTFT components of the prefill servers" in screen and "TTFT components of the decode servers" in screen
        wide = {**os.environ, "COLUMNS": "230"}  # rich's width off a terminal
        once = subprocess.run([*top[:-1], "0.5", "--once"], capture_output=True, text=True, timeout=60, env=wide)
        assert once.returncode == 0, once.stdout + once.stderr
        assert top_rows(once.stdout, stack.pd.prefill_url) and top_rows(once.stdout, stack.pd.decode_url)
    except BaseException:
        print(screen)
        print(stack.logs())
        raise
    finally:
        stop.set()
        term.close()
        for c in clients:
            c.join(timeout=60)
