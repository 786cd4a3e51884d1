"""Graceful drain under load (issue 48): a 2P2D stack behind sglang-router (tiny preset), 16 streams
through the router (1,500 tokens each), then SIGTERM to one decode (its requests decoding) and,
later, to one prefill (its KV transfers in flight). Every stream completes or ends with a clear
error (finish reason abort with a message, an error event and [DONE], or an HTTP error with a
message), none hangs, the drained server exits 0 after freeing its pages and rooms (its summary
line), and the other servers' pages and rooms return to their start values. The drain times are
printed (docs/deploy.md)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpipe.launch.stack import PDStack
from kvpipe.launch.start import start_pd_stack
from tests.helpers.drain_load import (
    End,
    StreamResult,
    drain_summary,
    pages_and_rooms,
    run_streams,
    wait_until,
)
from tests.helpers.pd_parity import prompts

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.timeout(600)

STREAMS = 16
DEADLINE_S = 240.0  # a stream that has not ended by then hangs
NAMES = ("prefill0", "prefill1", "decode0", "decode1")


def stats(stack: PDStack, i: int) -> dict:
    url = stack.specs[i].health_url.removesuffix("/health")
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    logs = tmp_path_factory.mktemp("drain_logs")
    flags = ["--page-size", "16", "--max-total-tokens", "16384", "--disaggregation-heartbeat-interval", "0.5"]
    s = start_pd_stack(
        str(tiny_model_dir),
        server_args=flags,
        # the decode drains with a short bound: its long streams are cut (the abort path); the
        # prefill with a longer one: its transfers finish
        prefill_args=["--graceful-shutdown-timeout", "20"],
        decode_args=["--graceful-shutdown-timeout", "2"],
        log_dir=str(logs),
        timeout_s=240.0,
        prefills=2,
        decodes=2,
        prefill_policy="round_robin",
        decode_policy="round_robin",
    )
    s.log_dir = logs  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.close()


def bodies(lengths: list[int], new: int) -> list[dict]:
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    return [{"input_ids": p, "stream": True, "sampling_params": params} for p in prompts(lengths, seed=5)]


def check_clear(results: list[StreamResult | None]) -> dict[End, int]:
    counts: dict[End, int] = {}
    for r in results:
        assert r is not None, "a stream thread did not finish"
        assert r.end in (End.OK, End.ABORT, End.HTTP_ERROR), (r.end, r.detail, r.events[-3:])
        if r.end is End.ABORT and "shutting down" in r.detail:  # cut by the drain: an error event too
            assert r.error_events and r.error_events[-1]["error"]["code"] == 503, r.events[-3:]
        counts[r.end] = counts.get(r.end, 0) + 1
    return counts


def drain(
    stack: PDStack, i: int, busy: tuple[str, int], load: list[dict], others: list[int]
) -> tuple[dict, dict[End, int]]:
    """Start `load`, SIGTERM server i once its stats show `busy` (a count at least that high),
    check what the issue asks."""
    start = {j: pages_and_rooms(stats(stack, j)) for j in others}
    threads, results = run_streams(stack.router_url, load, DEADLINE_S)
    wait_until(lambda: _busy(stats(stack, i), *busy), 120, f"{NAMES[i]} busy ({busy})")
    proc = stack.procs[i]
    exited: list[float] = []
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    waiter = threading.Thread(target=lambda: (proc.wait(DEADLINE_S), exited.append(time.monotonic() - t0)))
    waiter.start()
    health = httpx.get(stack.specs[i].health_url, timeout=10)
    assert health.status_code == 503 and health.json() == {"status": "draining"}, health.text
    new = httpx.post(
        stack.specs[i].health_url.removesuffix("/health") + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
        timeout=10,
    )
    assert new.status_code == 503 and new.headers.get("retry-after") and "shutting down" in new.text, new.text
    for t in threads:
        t.join(DEADLINE_S + 30)
    waiter.join(60)
    assert proc.poll() == 0 and exited, f"{NAMES[i]} exited with {proc.returncode}"
    exit_s = exited[0]
    counts = check_clear(results)
    summary = drain_summary(Path(stack.log_dir) / f"{NAMES[i]}.log")  # type: ignore[attr-defined]
    assert summary["settled"] and summary["free_pages"] == summary["total_pages"], summary
    assert not summary["active_rooms"] and not summary["transfer_rooms"], summary
    for j in others:  # pages and rooms of the servers left return to where they started
        wait_until(lambda j=j: pages_and_rooms(stats(stack, j)) == start[j], 90, f"{NAMES[j]} back to {start[j]}")
    print(f"\n{NAMES[i]} drain: {summary}, exit after SIGTERM {exit_s:.2f} s, streams {counts}")
    return summary, counts


def _busy(st: dict, what: str, at_least: int) -> bool:
    pd = st.get("disaggregation") or {}
    return (st.get(what) or pd.get(what) or 0) >= at_least


def test_sigterm_to_a_decode_under_16_streams(stack: PDStack) -> None:
    # 1,500 tokens outlast the 2 s bound (a stream made 30-150 tokens/s here, 2026-12-02); the other
    # decode's streams run to their end, 100 s of make test's worker time at the 3,000 it had
    summary, counts = drain(stack, 2, ("num_running", 4), bodies([32] * STREAMS, 1500), others=[0, 1, 3])
    assert summary["timed_out"] and summary["aborted"] > 0, summary
    assert counts.get(End.OK, 0) > 0, counts  # the other decode's streams finished
    # a cut stream ends with an abort; one the decode cut before its first token may instead be
    # retried by the router on the other decode (the prefill's half failed), and finish there
    assert counts.get(End.ABORT, 0) > 0, counts


def test_sigterm_to_a_prefill_with_transfers_in_flight(stack: PDStack) -> None:
    # long prompts: the prefill computes and ships KV for a while; the decode left (decode1) and
    # prefill1 serve on
    summary, counts = drain(stack, 0, ("active_rooms", 1), bodies([1500] * STREAMS, 8), others=[1, 3])
    assert summary["in_flight"] > 0, summary
    assert counts.get(End.OK, 0) > 0, counts
