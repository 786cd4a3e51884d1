"""A prefill rank in a process of its own, for liveness tests that starve or stop it
(tests/integration/test_starved_peer.py): a KVSender over Mooncake (loopback TCP) with the rig's
pool (kv_transfer.truth(seed 0)), its bootstrap server, and a line protocol on stdin/stdout:

    -> "port <bootstrap port>"          started
    <- "rooms 1 2 3"                     admit these rooms (page table kv_transfer.SRC)
    -> "bound"                           every room's decode request arrived
    <- "compute <seconds>"              keep the main thread busy in Python (a GIL-heavy forward),
                                         then send every room's KV
    -> "done <room>:<state> ..."         every room's final state on this side

    python -m tests.helpers.starved_prefill <heartbeat interval s> <misses>

Every wait is bounded (60 s); the process exits when stdin closes."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

from tests.helpers.kv_transfer import CFG, SRC, Results, start_prefill, wait_for


def busy(seconds: float) -> int:
    """Pure-Python work for `seconds` (holds the GIL between bytecodes, as a forward's Python does)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(i * i for i in range(2000)) % 7
    return n


def main(interval_s: float, misses: int) -> None:
    cfg = dataclasses.replace(
        CFG,
        heartbeat_interval_s=interval_s,
        heartbeat_misses=misses,
        bootstrap_timeout_s=30.0,
        waiting_timeout_s=60.0,
        transfer_timeout_s=60.0,
    )
    with contextlib.ExitStack() as stack:
        prefill = start_prefill(stack, kind="mooncake", cfg=cfg, instance="starved")
        sender = prefill.senders[0]
        print(f"port {prefill.port}", flush=True)
        rooms: list[int] = []
        for line in sys.stdin:
            word, *args = line.split()
            if word == "rooms":
                rooms = [int(a) for a in args]
                for room in rooms:
                    sender.add_room(room, SRC)
                wait_for(lambda: all(map(sender.is_bound, rooms)), 60, "decode requests")  # noqa: B023
                print("bound", flush=True)
            elif word == "compute":
                busy(float(args[0]))
                for room in rooms:
                    sender.send(room, 0, 22, last=True, aux=(room, -0.5))
                res = Results(sender)
                states = [res.get(room, timeout=60)[1].name for room in rooms]
                print("done " + " ".join(f"{r}:{s}" for r, s in zip(rooms, states)), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
