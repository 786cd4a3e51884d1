"""Layer-pipelined transfer bookkeeping: event-gated send calls, link busy accounting in the
sender book, the engine-side LayerPipeline (timing, link samples, stats) and the flag."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ConfigError, DisaggregationConfig, TransferTuning
from kvpipe.disagg.layer_groups import GroupChoice, LayerGroupPolicy
from kvpipe.disagg.layer_pipeline import MIN_LINK_SAMPLE_BYTES, LayerPipeline
from kvpipe.transfer.backends.base import BatchHandle, BatchState
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.wire_bytes import KVWireBytes
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import SendCall
from kvpipe.transfer.sender.stats import TransferTiming
from tests.helpers.registered import register_answered

L, PS, HD, PAGES = 4, 4, 8, 64


def layout(base: int) -> KVLayout:
    return KVLayout(
        L, PS, 2, 0, 2, HD, "float32", 4, tuple(base + i * (1 << 20) for i in range(2 * L)), PAGES * 2 * PS * HD * 4
    )


def book() -> SenderBook:
    cfg = DisaggregationConfig(tuning=TransferTuning(max_inflight_ops=1024))
    b = SenderBook(cfg, layout(1 << 30), 0, 1, "p/0", lambda a, msg: True)
    register_answered(b, m.RegisterPeer("d/0", 0, 1, "data-d", "tcp://d", layout(1 << 40)), 0.0)
    b.add_room(1, np.arange(8), 0.0)
    b.on_message(m.TransferRequest(1, "d/0", tuple(range(8)), 0, 0), 0.0)
    return b


def submit(b: SenderBook, now: float) -> list:
    take, _, _ = b.take_work(now)
    b.record(
        [(r, bt, BatchHandle(i, bt.peer, bt.num_ops, 1000 * bt.num_ops), None) for i, (r, bt) in enumerate(take)],
        [],
        now,
    )
    return take


def finish(b: SenderBook, now: float) -> bool:
    return b.record([], [(r, inf, BatchState.DONE) for r in b.rooms.values() for inf in r.inflight], now)


def test_send_call_waits_for_its_compute_event():
    b = book()
    done = {"g0": False}
    b.add_call(1, SendCall(0, 32, 0, 2, False, ready=lambda: done["g0"]), None)
    b.add_call(1, SendCall(0, 32, 2, 4, False), None)  # a later group: queued behind the first
    assert submit(b, 0.1) == []
    assert finish(b, 0.1)  # the worker keeps ticking while a call waits on an event
    done["g0"] = True
    take = submit(b, 0.2)
    layers = {(int(a) - (1 << 30)) >> 21 for _, bt in take for a in bt.src}  # buffer index // 2 = layer
    assert take and layers == {0, 1, 2, 3}


def test_link_busy_time_counts_only_periods_with_writes_in_flight():
    b = book()
    b.add_call(1, SendCall(0, 16, 0, 2, False), None)
    submit(b, 1.0)
    finish(b, 1.5)  # 0.5 s busy
    assert b.stats.busy_s == pytest.approx(0.5) and b.stats.busy_bytes == b.stats.bytes_written > 0
    b.add_call(1, SendCall(0, 32, 0, 4, True), (3, -0.1))  # idle 1.5 .. 3.0 is not busy time
    submit(b, 3.0)
    finish(b, 3.25)
    assert b.stats.busy_s == pytest.approx(0.75) and b.stats.busy_bytes == b.stats.bytes_written
    [(room, state, _)] = b.poll(3.25)
    [t] = b.timings
    assert (room, t.room, t.nbytes) == (1, 1, b.stats.bytes_written)
    assert t.busy_s == pytest.approx(0.75) and (t.first_submit_at, t.last_done_at) == (1.0, 3.25)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_layer_pipeline_times_batches_and_samples_the_link():
    clock = FakeClock()
    pipe = LayerPipeline(LayerGroupPolicy(), num_layers=4, token_nbytes=1000, clock=clock)
    assert pipe.begin(tokens=2048, send_tokens=2048).reason == "no-estimate"
    clock.t = 0.4
    pipe.end()
    assert pipe.planner.compute.ms_per_layer(2048) == pytest.approx(100.0)
    pipe.observe_link(MIN_LINK_SAMPLE_BYTES // 2, 0.001)  # too few bytes: keeps accumulating
    assert pipe.planner.link.bytes_per_ms is None
    pipe.observe_link(2 * MIN_LINK_SAMPLE_BYTES, 0.1024)  # 5,120 bytes per ms
    assert pipe.planner.link.bytes_per_ms == pytest.approx(2 * MIN_LINK_SAMPLE_BYTES / 102.4)
    # T = 2048 * 1000 B / rate = 400 ms = C: pipelining pays
    ch = pipe.begin(tokens=2048, send_tokens=2048)
    assert ch.reason == "cost-model" and ch.groups == 4
    assert pipe.begin(tokens=100, send_tokens=100).reason == "short"
    s = pipe.stats()
    assert s["num_groups"] == 1 and s["reason"] == "short" and s["policy"] == "auto"
    assert s["batches_by_groups"] == {"1": 2, "4": 1} and s["link_goodput_gbps"] > 0


def test_fixed_policy_and_flag():
    pipe = LayerPipeline(LayerGroupPolicy.parse(3), num_layers=4, token_nbytes=1)
    assert pipe.begin(1, 1).groups == 3 and pipe.stats()["policy"] == 3

    def parse(*flags: str) -> DisaggregationConfig:
        argv = ["serve", "--model-path", "m", *flags]
        parser, _ = build_parser(argv)
        return server_config_from_args(parser.parse_args(argv)).disaggregation

    assert parse().layer_groups == "auto"
    assert parse("--disaggregation-layer-groups", "AUTO").layer_groups == "auto"
    assert parse("--disaggregation-layer-groups", "4").layer_groups == 4
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse("--disaggregation-layer-groups", bad)
    with pytest.raises(ConfigError):
        DisaggregationConfig(layer_groups="3")  # type: ignore[arg-type]  # ints are ints


def test_observers_hear_every_choice_and_landed_room():
    heard: list = []

    class Spy:
        def on_layer_groups(self, tokens: int, choice: GroupChoice) -> None:
            heard.append(("groups", tokens, choice.groups))

        def on_room_landed(self, timing: TransferTiming, tail_ms: float | None) -> None:
            heard.append(("room", timing.room, tail_ms))

    clock = FakeClock()
    pipe = LayerPipeline(
        LayerGroupPolicy(fixed_groups=2), num_layers=4, token_nbytes=10, clock=clock, observers=[Spy()]
    )
    pipe.begin(tokens=100, send_tokens=100)
    pipe.end()
    timing = TransferTiming(room=3, nbytes=1000, busy_s=0.01, first_submit_at=1.0, last_done_at=2.5)
    pipe.room_done(timing, forward_done_at=2.0)
    pipe.room_done(TransferTiming(room=4, nbytes=500, busy_s=0.01, first_submit_at=1.0, last_done_at=2.0), None)
    assert heard == [("groups", 100, 2), ("room", 3, 500.0), ("room", 4, None)]
    c = pipe.counters
    assert (c.rooms_landed, c.bytes_landed, c.tail_count, c.tail_ms_sum) == (2, 1500, 1, 500.0)
    assert c.snapshot() == {
        "num_groups": 2,
        "layer_groups_reason": "fixed",
        "layer_group_batches": {2: 1},
        "transfer_tail_ms_sum": 500.0,
        "transfer_tail_count": 1,
    }


def test_a_hybrid_batch_counts_each_final_state_once_whatever_its_length():
    """T of the cost model: KV per token of the full-attention layers plus, for every request
    whose last forward this is, one state slot (it does not grow with the prompt)."""
    pipe = LayerPipeline(LayerGroupPolicy(min_tokens=1), num_layers=4, token_nbytes=512, state_nbytes=116736)
    pipe.planner.compute.observe(1024, 4, 10.0)
    pipe.planner.link.observe(1000, 1.0)  # 1000 bytes per ms
    assert pipe.begin(1024, 1024).transfer_ms == pytest.approx(1024 * 512 / 1000)  # a chunk: no state yet
    pipe.end()
    assert pipe.begin(1024, 1024, send_states=2).transfer_ms == pytest.approx((1024 * 512 + 2 * 116736) / 1000)


def test_sliding_window_bytes_replace_tokens_x_token_nbytes():
    # the prefill passes what a chunk weighs on the wire (kv_wire_bytes): a sliding-window model's
    # sliding layers send the window only, fewer than send_tokens x token_nbytes
    wire = KVWireBytes(1024, 1024, 32, 16)  # tiny-gpt-oss
    pipe = LayerPipeline(LayerGroupPolicy(min_tokens=1), num_layers=4, token_nbytes=2048)
    pipe.planner.compute.observe(1024, 4, 10.0)
    pipe.planner.link.observe(1000, 1.0)  # 1000 bytes / ms
    assert pipe.begin(1000, 1000).transfer_ms == pytest.approx(1000 * 2048 / 1000)
    sent = wire.request_nbytes(1000)
    assert sent == 1000 * 1024 + 40 * 1024  # window pages from (1000 - 31) // 16 = 60: tokens 960..999
    assert pipe.begin(1000, 1000, send_kv_bytes=sent).transfer_ms == pytest.approx(sent / 1000)
