"""Issue 30, finding 3 (bookkeeping half): what decoding a control frame may allocate.

A forged frame must be refused before it expands: the limits follow from the message classes an
endpoint receives and the longest int list it can legitimately get (a pool's pages), the frame
size bound is the largest legit encoding under them (and no smaller), and a frame of nested
containers is refused while unpacking, its allocations bounded by its own size."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest

from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.codec import MAP_COUNT_FROM_BYTES, MAX_STR_BYTES, MAX_TEXT_CHARS

PAGES = 1000  # a pool's pages: the longest page list an endpoint of that pool accepts
LONG = "x" * MAX_STR_BYTES  # the longest str any field may carry


def _largest_request() -> m.TransferRequest:
    """The longest TransferRequest a decode can send a prefill whose pool has PAGES pages."""
    return m.TransferRequest((1 << 63) - 1, LONG, tuple(range(PAGES)), (1 << 63) - 1, (1 << 63) - 1, (1 << 63) - 1)


def test_the_frame_bound_covers_the_largest_legit_message_and_nothing_longer_decodes():
    limits = m.limits_for(m.SENDER_RECEIVES, PAGES)
    big = m.encode(_largest_request())
    assert len(big) <= limits.max_frame_bytes  # sound: a real message always fits
    assert m.decode(big, limits) == _largest_request()
    longer = m.encode(m.TransferRequest(1, "d/0", tuple(range(PAGES + 1)), 0, 0))
    with pytest.raises(m.ProtocolError, match="exceeds max_bin_len"):
        m.decode(longer, limits)  # one page more than the pool holds
    with pytest.raises(m.ProtocolError, match="exceeds"):
        m.decode(big + b"\x00" * (limits.max_frame_bytes - len(big) + 1), limits)  # over the frame bound
    # the bound is tight enough to matter: a few page lists of the pool, not the 64 MiB of before
    # (the widest message, RegisterPeer, holds two KV layouts since protocol 7: the draft model's)
    assert limits.max_frame_bytes < 10 * (8 * PAGES + MAX_STR_BYTES) and limits.max_bin_len == 8 * PAGES


def test_a_decode_receives_no_int_lists_and_small_frames():
    limits = m.limits_for(m.RECEIVER_RECEIVES, 0)
    st = m.TransferStatus(1, LONG, m.WireState.FAILED, "r" * MAX_TEXT_CHARS, None, LONG)
    assert len(m.encode(st)) <= limits.max_frame_bytes < 32 << 10
    assert m.decode(m.encode(st), limits) == st
    req = m.encode(m.TransferRequest(1, "d/0", (1, 2), 0, 0))  # a prefill's message, sent to a decode
    with pytest.raises(m.ProtocolError):
        m.decode(req, limits)  # no room for its page list (max_bin_len 8) and a map kind it never gets


def test_long_reasons_are_cut_to_fit_and_other_long_strings_refused():
    st = m.TransferStatus(1, "d/0", m.WireState.FAILED, "é" * 10_000, sender="p/0")
    out = m.decode(m.encode(st), m.limits_for(m.RECEIVER_RECEIVES, 0))
    assert len(out.reason) == MAX_TEXT_CHARS and out.reason.endswith("...")
    hb = m.encode(m.Heartbeat("s" * (MAX_STR_BYTES + 1), 1))
    with pytest.raises(m.ProtocolError, match="max_str_len"):
        m.decode(hb)


def _peak_decode_bytes(frame: bytes) -> int:
    """Peak bytes Python allocated while `decode` refused the frame (msgpack allocates through it)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(m.ProtocolError):
            m.decode(frame)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_issues_msgpack_bomb_is_refused_before_it_expands():
    """8 MiB of empty arrays became 518 MiB of objects (issue 30): now refused at the array header,
    with allocations bounded by a fraction of the frame (under the default, widest limits)."""
    bomb = msgpack.packb(
        {"kind": "heartbeat", "version": m.PROTOCOL_VERSION, "session_id": "s", "seq": [[]] * (8 << 20)}
    )
    assert 8 << 20 < len(bomb) < m.DEFAULT_LIMITS.max_frame_bytes  # it passes the size check: msgpack sees it
    assert _peak_decode_bytes(bomb) < len(bomb) // 8


PAD = {f"pad{i}": "x" * 4000 for i in range(5)}  # 20 KB of legit-sized strings: past MAP_COUNT_FROM_BYTES


@pytest.mark.parametrize(
    "shape",
    [
        "nested maps",  # maps inside maps as deep as msgpack goes: more maps than any message has
        "wide maps",  # one map per field, many fields
        "many strings",  # the widest map allowed, every value a long str: the message is refused on its keys
    ],
)
def test_container_bombs_are_refused_with_bounded_allocations(shape):
    """Frames from MAP_COUNT_FROM_BYTES on are decoded counting their maps; smaller ones cannot
    expand past about 1 MiB whatever they hold."""
    if shape == "nested maps":
        inner: object = {}
        for _ in range(500):
            inner = {"k": inner}
        frame = msgpack.packb({"kind": "register_peer", "version": m.PROTOCOL_VERSION, **PAD, "layout": inner})
    elif shape == "wide maps":
        wide = {f"f{i}": {"a": {"b": {"c": {"d": {}}}}} for i in range(m.DEFAULT_LIMITS.max_map_len - len(PAD))}
        frame = msgpack.packb({**PAD, **wide})
    else:
        frame = msgpack.packb({f"f{i}": "v" * MAX_STR_BYTES for i in range(m.DEFAULT_LIMITS.max_map_len + 1)})
    assert len(frame) >= MAP_COUNT_FROM_BYTES
    assert _peak_decode_bytes(frame) < 2 * len(frame) + (64 << 10)


def test_a_small_frame_of_nested_maps_stays_small_without_the_map_count():
    inner: object = {}
    for _ in range(500):  # about as deep as msgpack nests
        inner = {"k": inner}
    frame = msgpack.packb({"kind": "register_peer", "version": m.PROTOCOL_VERSION, "layout": inner})
    assert len(frame) < MAP_COUNT_FROM_BYTES
    assert _peak_decode_bytes(frame) < 1 << 20
