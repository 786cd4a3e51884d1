"""Per-frame cost of the control plane's decoding limits (issue 30), isolated.

    python -m kvpipe.bench.transfer.frame_checks      # pin it to a core: taskset -c 1 python -m ...

For the frames a PD request exchanges it times the msgpack step of `messages.decode` with an
endpoint's limits (the frame-size check, msgpack's max_*_len, the map count on large frames)
against the same step without them (the protocol-5 decoder), and the whole decode both ways.
Repeats are interleaved and the minimum is kept: on a shared machine the least disturbed run is
the one that measures the code."""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import msgpack

from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.codec import MAP_COUNT_FROM_BYTES, MapCounter, WireLimits, from_wire

REPEATS, NUMBER = 15, 5000


def frames() -> dict[str, tuple[bytes, WireLimits]]:
    session = "d/0/" + "a" * 32  # a decode session as the receiver book makes them
    status = m.TransferStatus(7, session, m.WireState.SUCCESS, "", m.AuxData(7, 42, -0.25, 0), "p0/0")
    return {
        "TransferStatus(SUCCESS)": (m.encode(status), m.limits_for(m.RECEIVER_RECEIVES, 0)),
        "TransferRequest(64 pages)": (
            m.encode(m.TransferRequest(7, session, tuple(range(64)), 0, 3)),
            m.limits_for(m.SENDER_RECEIVES, 100_000),
        ),
        "Heartbeat": (m.encode(m.Heartbeat("p0/0", 5)), m.limits_for(m.RECEIVER_RECEIVES, 0)),
    }


def unchecked_unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)


def checked_unpack(data: bytes, limits: WireLimits) -> Any:
    if len(data) > limits.max_frame_bytes:
        raise m.ProtocolError("frame too long")
    hook = MapCounter(limits.max_maps) if len(data) >= MAP_COUNT_FROM_BYTES else None
    return msgpack.unpackb(
        data, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=hook, **limits.unpack_kwargs
    )


def unchecked_decode(data: bytes) -> Any:
    body = dict(unchecked_unpack(data))
    kind = body.pop("kind")
    body.pop("version")
    return from_wire(m.MESSAGE_TYPES[kind], body, kind)


def _us(fn: Callable[[], Any], out: list[float]) -> None:
    out.append(timeit.timeit(fn, number=NUMBER) / NUMBER * 1e6)


def measure(data: bytes, limits: WireLimits) -> dict[str, float]:
    """Minimum microseconds per frame of each way to decode it."""
    assert unchecked_decode(data) == m.decode(data, limits)
    ways: dict[str, Callable[[], Any]] = {
        "unpack": lambda: unchecked_unpack(data),
        "unpack+limits": lambda: checked_unpack(data, limits),
        "decode": lambda: unchecked_decode(data),
        "decode+limits": lambda: m.decode(data, limits),
    }
    runs: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(REPEATS):
        for k, fn in ways.items():
            _us(fn, runs[k])
    return {k: min(v) for k, v in runs.items()}


def main() -> None:
    print(f"min of {REPEATS} interleaved repeats of {NUMBER} calls, microseconds per frame")
    for name, (data, limits) in frames().items():
        b = measure(data, limits)
        print(
            f"{name:26s} {len(data):4d} B  msgpack step {b['unpack']:5.2f} -> {b['unpack+limits']:5.2f}"
            f"   whole decode {b['decode']:6.2f} -> {b['decode+limits']:6.2f}"
        )


if __name__ == "__main__":
    main()
