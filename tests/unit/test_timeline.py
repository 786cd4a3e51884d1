"""Timeline bookkeeping (kvpipe/engine/timeline.py) and the histograms fed from it
(kvpipe/server/metrics.py): order, components, and that the metrics' sums are the records'."""

from __future__ import annotations

import argparse
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.commands.flags import add_http_api_args, add_server_args, server_config_from_args
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.disagg.timeline_events import record_transfer
from kvpipe.engine.request import FinishReason, SamplingParams, TokenOutput
from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.server.async_engine import AsyncEngine
from kvpipe.server.metrics import PHASE_HISTOGRAMS, ServerMetrics
from kvpipe.server.protocol import BootstrapInfo, GenerateInput
from kvpipe.server.request_tracker import RequestTracker
from kvpipe.transfer.sender.stats import TransferTiming

T0 = 1000.0  # a monotonic clock reading; every other time is T0 + an exact binary fraction


def prefill_timeline() -> Timeline:
    """A prefill request in two chunks, layer-pipelined, whose transfer the sender reports late."""
    tl = Timeline()
    tl.mark(Phase.ARRIVED, T0)
    tl.mark(Phase.SCHEDULED, T0 + 0.25)
    tl.mark(Phase.FORWARD_START, T0 + 0.25, 24)
    tl.mark(Phase.FORWARD_END, T0 + 0.5, 24)
    tl.mark(Phase.FORWARD_START, T0 + 0.75, 16)  # another batch ran in between
    tl.mark(Phase.LAYER_GROUP_DONE, T0 + 0.875, 2)
    tl.mark(Phase.FORWARD_END, T0 + 1.0, 16)
    tl.mark(Phase.FIRST_TOKEN, T0 + 1.0)
    tl.mark(Phase.FINISHED, T0 + 1.0)
    # the room's timing arrives after the finish, with earlier sender times
    spans = ((T0 + 0.5, T0 + 0.625), (T0 + 0.875, T0 + 1.125))  # a group of each chunk, on the wire
    record_transfer(tl, TransferTiming(7, 4096, 0.375, T0 + 0.5, T0 + 1.125, T0 + 0.375, spans))
    tl.mark(Phase.RELEASED, T0 + 1.25)
    return tl


def test_record_sorts_late_events_and_keeps_chunk_order() -> None:
    rec = prefill_timeline().record()
    ts = [e.t for e in rec.events]
    assert ts == sorted(ts)
    phases = [e.phase for e in rec.events]
    assert phases.index(Phase.BOOTSTRAPPED) < phases.index(Phase.FORWARD_END)  # by time, not by when recorded
    assert phases[-2:] == [Phase.TRANSFER_DONE, Phase.RELEASED]
    wire = [(e.phase, e.t - T0) for e in rec.events if e.phase in (Phase.TRANSFER_START, Phase.TRANSFER_DONE)]
    assert wire == [
        (Phase.TRANSFER_START, 0.5),
        (Phase.TRANSFER_DONE, 0.625),
        (Phase.TRANSFER_START, 0.875),
        (Phase.TRANSFER_DONE, 1.125),
    ]
    # a chunk's start and end stay paired in order (equal times keep their recording order)
    chunks = [(e.phase, e.value) for e in rec.events if e.phase in (Phase.FORWARD_START, Phase.FORWARD_END)]
    assert chunks == [
        (Phase.FORWARD_START, 24),
        (Phase.FORWARD_END, 24),
        (Phase.FORWARD_START, 16),
        (Phase.FORWARD_END, 16),
    ]
    assert rec.transfer_bytes == 4096


def test_prefill_components() -> None:
    rec = prefill_timeline().record()
    c = rec.components()
    assert c == {
        "queue": 0.25,
        "prefill_compute": 0.5,  # two chunks of 0.25 s, not the 0.75 s span
        "bootstrap_wait": 0.375,
        "transfer": 0.625,
        "exposed_transfer": 0.125,  # last forward end -> last write done
    }
    # disjoint parts of the request's time on this server
    assert c["queue"] + c["prefill_compute"] + c["exposed_transfer"] <= rec.last(Phase.RELEASED) - T0  # type: ignore[operator]
    js = rec.to_json()
    assert js["arrived_monotonic"] == T0 and js["events"][0] == {"phase": "arrived", "t": 0.0}
    assert js["components"] == c and js["transfer_bytes"] == 4096


def test_decode_components_add_up_to_its_time() -> None:
    tl = Timeline(prefix_hit_tokens=32)
    for phase, t in [
        (Phase.ARRIVED, T0),
        (Phase.PAGES_RESERVED, T0 + 0.125),
        (Phase.KV_ARRIVED, T0 + 0.625),
        (Phase.FIRST_TOKEN, T0 + 0.625),
        (Phase.FINISHED, T0 + 2.0),
    ]:
        tl.mark(phase, t)
    rec = tl.record()
    c = rec.components()
    assert c == {"decode_wait": 0.125, "kv_wait": 0.5, "decoding": 1.375}
    assert sum(c.values()) == pytest.approx(2.0, abs=4 * math.ulp(T0 + 2.0))


def test_a_request_aborted_in_the_queue_has_no_compute() -> None:
    tl = Timeline()
    tl.mark(Phase.ARRIVED, T0)
    tl.mark(Phase.FINISHED, T0 + 0.5)
    assert tl.record().components() == {}
    assert not tl.has(Phase.SCHEDULED) and tl.has(Phase.FINISHED)


def _samples(m: ServerMetrics) -> dict[tuple[str, str], float]:
    """(sample name, role) -> value of every labelled sample in /metrics."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if "role" in s.labels and "le" not in s.labels:
                out[(s.name, s.labels["role"])] = s.value
    return out


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_histograms_sum_the_records(role: str) -> None:
    m = ServerMetrics("tiny", lambda: None, role)
    recs = [prefill_timeline().record(), prefill_timeline().record()]
    for rec in recs:
        m.on_timeline(rec)
    got = _samples(m)
    for key, (name, _, roles) in PHASE_HISTOGRAMS.items():
        want = [r.components()[key] for r in recs if key in r.components()]
        if role not in roles:  # e.g. a colocated server has no transfer: no series
            assert (f"{name}_count", role) not in got
            continue
        assert got[(f"{name}_count", role)] == len(want)
        assert got[(f"{name}_sum", role)] == pytest.approx(sum(want), abs=8 * math.ulp(T0))
    if role == "prefill":
        assert got[("kvpipe_kv_transfer_request_bytes_count", role)] == 2
        assert got[("kvpipe_kv_transfer_request_bytes_sum", role)] == 8192
    assert got[("kvpipe_request_prefix_hit_tokens_count", role)] == 2


def test_decode_histograms_and_roles() -> None:
    m = ServerMetrics("tiny", lambda: None, "decode")
    fresh = _samples(m)  # before any request: the decode's series, at zero, and no prefill ones
    assert fresh[("kvpipe_kv_wait_seconds_count", "decode")] == 0
    assert ("kvpipe_queue_time_seconds_count", "decode") not in fresh
    tl = Timeline(prefix_hit_tokens=48)
    for phase, t in [(Phase.ARRIVED, T0), (Phase.PAGES_RESERVED, T0 + 0.25), (Phase.KV_ARRIVED, T0 + 0.75)]:
        tl.mark(phase, t)
    tl.mark(Phase.FINISHED, T0 + 1.0)
    m.on_timeline(tl.record())
    got = _samples(m)
    assert got[("kvpipe_decode_wait_seconds_sum", "decode")] == 0.25
    assert got[("kvpipe_kv_wait_seconds_sum", "decode")] == 0.5
    assert got[("kvpipe_request_prefix_hit_tokens_sum", "decode")] == 48
    assert ("kvpipe_queue_time_seconds_count", "decode") not in got  # a decode has no prefill queue


class _NoText:
    """A detokenizer for outputs without tokens (the history test needs no text)."""

    def add(self, new_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def test_debug_history_keeps_the_last_n_finished_requests() -> None:
    ae = AsyncEngine(lambda: None, history=2)  # type: ignore[arg-type, return-value]  # never started
    ae.metrics = ServerMetrics("tiny", lambda: None, "prefill")
    for i in range(3):
        inp = GenerateInput(f"r{i}", (5, 6), SamplingParams(), bootstrap=BootstrapInfo("h", 1, 100 + i))
        tr = RequestTracker(inp, _NoText(), start_time=0.0)
        rec = prefill_timeline().record()
        tr.update([TokenOutput(f"r{i}", (), (), FinishReason.LENGTH, None, 2, 0, timeline=rec)], now=1.0)
        assert tr.timeline is rec
        ae._on_finished(tr)
    assert [(r["rid"], r["bootstrap_room"], r["finish_reason"]) for r in ae.recent] == [
        ("r1", 101, "length"),
        ("r2", 102, "length"),
    ]
    assert ae.recent[-1]["timeline"] == prefill_timeline().record().to_json()
    assert _samples(ae.metrics)[("kvpipe_queue_time_seconds_count", "prefill")] == 3  # metrics saw all three


@pytest.mark.parametrize(("argv", "want"), [([], 256), (["--debug-requests-history", "0"], 0)])
def test_debug_requests_history_flag(tmp_path, argv: list[str], want: int) -> None:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_http_api_args(p)
    cfg = server_config_from_args(p.parse_args(["--model-path", str(tmp_path), *argv]))
    assert cfg.debug_requests_history == want
    with pytest.raises(ConfigError, match="debug request history"):
        ServerConfig(model_path=str(tmp_path), debug_requests_history=-1)
