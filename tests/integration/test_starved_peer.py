"""Liveness measures liveness (issue 50): a prefill rank in its own process, the decode's
KVReceiver here, Mooncake over loopback, heartbeat timeout 3 s.

- Starved, not stopped: its process shares one core with two busy processes at the same priority
  and its main thread is busy in Python (a GIL-heavy forward) for 10.5 s, 3.5x the timeout. Its
  heartbeats leave from their own thread (control/pulse.py), so the decode keeps its rooms, and
  when the compute ends the KV lands: every room succeeds with the right bytes.
- Stopped (SIGSTOP): the decode fails its rooms for the missed heartbeats, within the timeout
  plus a generous margin for a loaded machine."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.kv_transfer import CFG, SRC, Prefill, Results, assert_moved, start_decode, truth, wait_for

pytest.importorskip("mooncake.engine")

INTERVAL_S, MISSES = 0.5, 6  # heartbeat timeout 3 s: a loaded CI core may not run a thread for a second or two
ROOMS = [1, 2, 3]
ROOT = Path(__file__).resolve().parents[2]
HOG = "while True: pass"
DECODE_CFG = dataclasses.replace(
    CFG,
    heartbeat_interval_s=INTERVAL_S,
    heartbeat_misses=MISSES,
    bootstrap_timeout_s=30.0,
    waiting_timeout_s=60.0,
    transfer_timeout_s=60.0,
)


class Child:
    """The prefill process and its line protocol (tests/helpers/starved_prefill.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.starved_prefill", str(INTERVAL_S), str(MISSES)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def hear(self, word: str) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: every wait in the child is, and it exits on error
        assert line.startswith(word), f"prefill process said {line!r}, expected {word!r}"
        return line.split()[1:]

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot die of SIGKILL's cleanup
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child()
    try:
        yield c
    finally:
        c.close()


def bind_rooms(stack, child: Child):
    port = int(child.hear("port")[0])
    recv = start_decode(stack, kind="mooncake", cfg=DECODE_CFG)
    for i, room in enumerate(ROOMS):
        recv.add_room(room, "127.0.0.1", port, np.arange(6) + 6 * i, prefix_len=0)
    child.say("rooms " + " ".join(map(str, ROOMS)))
    child.hear("bound")
    return recv


def test_starved_prefill_keeps_its_rooms(stack, child: Child) -> None:
    recv = bind_rooms(stack, child)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    try:
        for pid in [child.proc.pid] + [h.pid for h in hogs]:
            os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})  # one core, three busy processes
        child.say(f"compute {3.5 * INTERVAL_S * MISSES}")
        # meanwhile the decode judges the prefill: no room may fail while it computes
        end = time.monotonic() + 3.5 * INTERVAL_S * MISSES
        while time.monotonic() < end:
            assert all(recv.room_state(r) is not TransferState.FAILED for r in ROOMS)
            time.sleep(0.05)
        assert child.hear("done") == [f"{r}:SUCCESS" for r in ROOMS]
    finally:
        for h in hogs:
            h.kill()
            h.wait(timeout=30)
    res = Results(recv)
    for room in ROOMS:
        assert res.get(room, timeout=30)[1] is TransferState.SUCCESS
    data = Prefill(None, [], truth(0))  # type: ignore[arg-type]  # the child's pool holds truth(seed 0)
    assert_moved(data, recv, np.concatenate([SRC] * 3), np.arange(18), np.arange(18, 32))


def test_stopped_prefill_fails_its_rooms(stack, child: Child) -> None:
    recv = bind_rooms(stack, child)
    os.kill(child.proc.pid, signal.SIGSTOP)
    timeout_s = INTERVAL_S * MISSES
    for room in ROOMS:  # the timeout plus a margin for a loaded machine (the worker's tick, scheduling)
        wait_for(lambda r=room: recv.room_state(r) is TransferState.FAILED, timeout_s + 10, f"room {room} failed")
    reasons = {recv._book.rooms[r].rec.reason for r in ROOMS}
    assert reasons == {
        f"prefill rank 0 at 127.0.0.1:{recv._book.rooms[1].prefill[1]} sent no heartbeat for {timeout_s:.1f}s"
    }
