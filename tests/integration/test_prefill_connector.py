"""PrefillConnector's bookkeeping with a fake WorkerGroup of two TP ranks (no model, no sockets
but its bootstrap server on loopback): what each forward and step tells the ranks, and when a
room is over (every rank reported it; the first failure stops it on the others; a rank that
exited fails its rooms)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.config import CacheConfig, DisaggregationConfig, ServerConfig
from kvpipe.disagg.commands import (
    AbortRooms,
    ChunkSend,
    FailRooms,
    PrefillStep,
    RankReport,
    RankStarted,
    SendChunks,
    StartPrefill,
)
from kvpipe.disagg.prefill import PrefillConnector
from kvpipe.engine.batch import ForwardMode, ScheduledBatch
from kvpipe.engine.connector import Admission, ConnectorContext, TransferFinished
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.registry import model_config
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.wire_bytes import KVWireBytes
from kvpipe.transfer.sender.stats import SenderStats

S, F = TransferState.SUCCESS, TransferState.FAILED
LAYERS, PS = 4, 4
MODEL = model_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
)


def layout(rank: int) -> KVLayout:
    return KVLayout(LAYERS, PS, 1, rank, 2, 8, "float32", 4, tuple(range(1, 2 * LAYERS + 1)), 64 * PS * 8 * 4)


class FakeWorkers:
    tp_size = 2

    def __init__(self) -> None:
        self.calls: list[object] = []
        self.posted: list[object] = []
        self.pending: list[tuple[int, object]] = []
        self.exited: dict[int, str] = {}

    def call(self, cmd: object, timeout_s: float) -> list[object]:
        self.calls.append(cmd)
        return [RankStarted(r, layout(r), f"data-{r}", f"tcp://ctl-{r}") for r in range(self.tp_size)]

    def post(self, cmd: object) -> None:
        self.posted.append(cmd)

    def reports(self) -> list[tuple[int, object]]:
        out, self.pending = self.pending, []
        return out

    def gone(self) -> dict[int, str]:
        return dict(self.exited)

    def report(self, rank: int, *results: tuple[int, TransferState, str]) -> None:
        self.pending.append((rank, RankReport(rank, tuple(results), SenderStats(bytes_written=10 * (rank + 1)))))


@pytest.fixture
def conn():
    cfg = ServerConfig(
        "unused",
        cache=CacheConfig(page_size=PS),
        disaggregation=DisaggregationConfig(mode="prefill", bootstrap_port=0, transfer_backend="local", layer_groups=2),
    )
    c = PrefillConnector(cfg)
    workers = FakeWorkers()
    c.start(ConnectorContext(cfg, MODEL, workers))
    try:
        yield c, workers
    finally:
        c.shutdown()


def admitted(c: PrefillConnector, rid: str, room: int, n: int) -> Req:
    req = Req(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=50), bootstrap_room=room)
    c.claim(req)
    assert c.admit(req) is Admission.LOCAL and req.params.max_new_tokens == 1
    req.pages = np.arange(-(-n // PS), dtype=np.int64) + 3
    return req


def prefill(c: PrefillConnector, req: Req, start: int, end: int, first: int | None = None) -> PrefillStep:
    batch = ScheduledBatch(ForwardMode.PREFILL, [req], [end - start], [start])
    plan = c.plan_forward(batch)
    c.after_forward(batch)
    if first is not None:
        req.output_ids.append(first)
        req.output_logprobs.append(-0.5)
    c.after_commit(batch)
    assert isinstance(plan.meta, PrefillStep) and plan.layer_groups == 2
    return plan.meta


def test_start_claims_and_what_each_step_ships(conn) -> None:
    c, w = conn
    assert isinstance(w.calls[0], StartPrefill) and w.calls[0].bootstrap[1] == c.bootstrap_port
    with pytest.raises(ValueError, match="bootstrap_room"):
        c.claim(Req("x", [1], SamplingParams()))
    req = admitted(c, "a", 7, 10)
    with pytest.raises(ValueError, match="already in use"):
        c.claim(Req("b", [1], SamplingParams(), bootstrap_room=7))
    m1 = prefill(c, req, 0, 6)
    assert [s.room for s in m1.start] == [7] and m1.start[0].pages.tolist() == [3, 4, 5]
    assert m1.grouped == (ChunkSend(7, 0, 6),)  # pipelined: sent from each rank's layer-group hook
    assert w.posted == []  # nothing more after a grouped chunk that is not the last
    m2 = prefill(c, req, 6, 10, first=42)
    assert m2.start == () and m2.grouped == (ChunkSend(7, 6, 10, state=True),)  # the last forward: final state
    assert w.posted == [SendChunks((ChunkSend(7, 6, 10, last=True, aux=(42, -0.5, 0, b"")),))]  # b"": no hidden row
    assert c.on_finish(req, FinishReason.LENGTH, 1) is True  # the transfer owns the pages
    w.report(0, (7, S, ""))
    assert c.poll() == []  # rank 1 has not reported
    w.report(1, (7, S, ""))
    assert c.poll() == [TransferFinished("a", True, "")]
    st = c.stats()["disaggregation"]
    assert st["rooms_succeeded"] == 1 and st["bytes_written"] == 30 and st["active_rooms"] == 0
    c.claim(Req("again", [1], SamplingParams(), bootstrap_room=7))  # the room is free again


def test_first_failure_stops_the_room_on_the_other_ranks(conn) -> None:
    c, w = conn
    req = admitted(c, "a", 8, 8)
    prefill(c, req, 0, 8, first=1)
    w.posted.clear()
    w.report(1, (8, F, "write failed"))
    assert c.poll() == [] and w.posted == [AbortRooms(((8, "prefill TP rank 1: write failed"),))]
    w.report(0, (8, F, "aborted"))
    assert c.poll() == [TransferFinished("a", False, "prefill TP rank 1: write failed")]


def test_a_rank_that_exited_fails_its_rooms(conn) -> None:
    c, w = conn
    req = admitted(c, "a", 9, 8)
    prefill(c, req, 0, 4)
    w.exited[1] = "TP rank 1 exited (exit code -9)"
    w.posted.clear()
    assert c.poll() == [] and w.posted == [AbortRooms(((9, "prefill TP rank 1: TP rank 1 exited (exit code -9)"),))]
    w.report(0, (9, F, "aborted"))
    [ev] = c.poll()
    assert isinstance(ev, TransferFinished) and not ev.ok and "exit code -9" in ev.reason
    # the engine stops the request; the connector holds nothing any more
    assert c.on_finish(req, FinishReason.ABORT, f"KV transfer failed: {ev.reason}") is False


def test_a_failure_before_the_first_forward_reaches_the_decode(conn) -> None:
    c, w = conn
    req = admitted(c, "a", 10, 500)
    assert c.on_finish(req, FinishReason.ABORT, "the prompt is too long") is True
    assert w.posted == [FailRooms(((10, "prefill failed: the prompt is too long"),))]
    w.report(0, (10, F, "x"))
    w.report(1, (10, F, "x"))
    assert [e.ok for e in c.poll()] == [False]


def test_layer_groups_see_what_a_chunk_weighs_on_the_wire(conn, monkeypatch) -> None:
    c, _ = conn
    assert c.pipeline is not None
    # rank 0's layout: 4 layers, K and V of 1 head x 8, fp32: 256 bytes a token, no sliding layers
    assert c.kv_wire == KVWireBytes(256, page_size=PS)
    seen, begin = [], c.pipeline.begin
    monkeypatch.setattr(c.pipeline, "begin", lambda *a: seen.append(a) or begin(*a))
    req = admitted(c, "a", 9, 10)
    prefill(c, req, 0, 6)
    assert seen[-1][1:] == (6, 0, 6 * 256)  # send_tokens, send_states, send_kv_bytes
    # as for a sliding-window model (2 of the 4 layers, window 4): the 10-token prompt's window
    # pages start at page (10 - 3) // 4 = 1, so the sliding layers send all 4 tokens of chunk 6..10
    c.kv_wire = KVWireBytes(128, 128, 4, PS)
    prefill(c, req, 6, 10, first=1)
    assert seen[-1][1:] == (4, 1, 4 * 128 + 4 * 128)
    assert c.kv_wire.span_nbytes(0, 6, 10) == 6 * 128 + 2 * 128  # tokens 4, 5 of the first chunk


def test_auto_layer_groups_take_the_configured_min_tokens() -> None:
    d = DisaggregationConfig(mode="prefill", bootstrap_port=0, transfer_backend="local", layer_groups_min_tokens=100)
    cfg = ServerConfig("unused", cache=CacheConfig(page_size=PS), disaggregation=d)
    c = PrefillConnector(cfg)
    c.start(ConnectorContext(cfg, MODEL, FakeWorkers()))
    try:
        assert c.pipeline is not None
        assert (c.pipeline.policy.fixed_groups, c.pipeline.policy.min_tokens) == (None, 100)
    finally:
        c.shutdown()
