"""The graceful drain's bookkeeping (kvpipe/server/drain.py): phases, the deadline, a second signal,
when the engine counts as settled; and the async engine's refusal and drain aborts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpipe.engine.request import FinishReason, SamplingParams
from kvpipe.server.async_engine import AsyncEngine
from kvpipe.server.drain import DRAIN_DETAIL, Drain, DrainAction, DrainPhase, engine_settled, is_drain_abort
from kvpipe.server.errors import APIError
from kvpipe.server.protocol import GenerateInput

IDLE: dict[str, Any] = {"num_running": 0, "num_waiting": 0, "num_reserved": 0, "num_held": 0}


def test_serving_does_nothing_and_the_first_signal_starts_draining() -> None:
    d = Drain(timeout_s=30.0)
    assert d.step(0.0, 5, False) is DrainAction.NONE and not d.draining
    assert d.begin(10.0) and d.phase is DrainPhase.DRAINING and d.deadline == 40.0
    assert d.step(11.0, 5, False) is DrainAction.NONE


def test_drain_exits_once_nothing_is_left_and_settled() -> None:
    d = Drain(timeout_s=30.0)
    d.begin(0.0)
    assert d.step(1.0, 0, False) is DrainAction.NONE  # requests gone, a PD room still open
    assert d.step(2.0, 0, True) is DrainAction.EXIT
    assert d.phase is DrainPhase.DONE and d.aborted_at is None
    assert d.step(3.0, 0, True) is DrainAction.NONE  # exit is asked once


def test_the_deadline_aborts_what_is_left_then_waits_bounded_for_pages_and_rooms() -> None:
    d = Drain(timeout_s=5.0, settle_s=2.0)
    d.begin(0.0)
    d.in_flight = 4
    assert d.step(4.9, 3, False) is DrainAction.NONE
    assert d.step(5.0, 3, False) is DrainAction.ABORT_ALL
    assert d.phase is DrainPhase.ABORTING and d.aborted == 3
    assert d.step(6.0, 0, False) is DrainAction.NONE
    assert d.step(7.0, 0, False) is DrainAction.EXIT  # settle_s passed: exit anyway
    s = d.summary({**IDLE, "free_pages": 10, "total_pages": 10, "disaggregation": {"active_rooms": 0}})
    assert s["finished"] == 1 and s["aborted"] == 3 and s["timed_out"] and s["seconds"] == 7.0
    assert s["free_pages"] == s["total_pages"] == 10 and s["settled"]


def test_a_second_signal_moves_the_deadline_to_now() -> None:
    d = Drain(timeout_s=300.0)
    assert d.begin(0.0)
    assert not d.begin(1.0)
    assert d.step(1.0, 2, False) is DrainAction.ABORT_ALL


def test_zero_timeout_aborts_at_once() -> None:
    d = Drain(timeout_s=0.0)
    d.begin(0.0)
    assert d.step(0.0, 1, False) is DrainAction.ABORT_ALL


@pytest.mark.parametrize(
    ("stats", "settled"),
    [
        (None, True),
        (IDLE, True),
        ({**IDLE, "num_running": 1}, False),
        ({**IDLE, "num_held": 2}, False),  # pages kept until the peer acknowledges an abort
        ({**IDLE, "disaggregation": {"active_rooms": 1, "transfer_rooms": 0}}, False),
        ({**IDLE, "disaggregation": {"active_rooms": 0, "transfer_rooms": 2}}, False),
        ({**IDLE, "disaggregation": {"active_rooms": 0, "transfer_rooms": None}}, True),
    ],
)
def test_engine_settled(stats: dict[str, Any] | None, settled: bool) -> None:
    assert engine_settled(stats) is settled


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


class _Engine:
    """An engine that takes requests and never steps them (the drain ends them)."""

    eos_token_ids = (2,)
    context_length = 64

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.tokenizer = _Tok()

    def add_request(self, req: Any) -> None:
        pass

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def step(self) -> list:
        return []

    def poll_interval(self) -> float | None:
        return None

    def set_wakeup(self, fn: Any) -> None:
        pass

    def stats(self) -> dict:
        return dict(IDLE)

    def shutdown(self) -> None:
        pass


def test_refused_requests_and_drain_aborts_in_the_async_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvpipe.server.async_engine.IncrementalDetokenizer", lambda tok, skip: _Detok())

    async def run() -> None:
        engine = _Engine()
        ae = AsyncEngine(lambda: engine)
        ae.start()
        for _ in range(100):
            if ae.ready:
                break
            await asyncio.sleep(0.01)
        inp = GenerateInput(rid="r1", input_ids=(1, 2), params=SamplingParams(max_new_tokens=4))
        stream = ae.submit(inp)
        ae.refuse_new("draining")
        with pytest.raises(APIError) as e:
            ae.submit(GenerateInput(rid="r2", input_ids=(1,), params=SamplingParams(max_new_tokens=1)))
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        assert ae.abort_all_for(DRAIN_DETAIL) == 1
        outs = [o async for o in stream]
        assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ABORT and is_drain_abort(outs[0])
        assert engine.aborted == ["r1"] and ae.num_active() == 0
        await ae.stop()

    asyncio.run(run())


class _Detok:
    def add(self, ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""
