"""Property tests of the control-plane codec: every generated message of every kind round-trips,
and `decode` answers any garbage (bytes, msgpack of any shape, a valid message with one field
broken) with a message or ProtocolError, never another exception (a peer's bytes must not kill a
control thread)."""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.codec import ProtocolError, _hints, _is_int_tuple, _optional_inner
from kvpipe.transfer.control.messages import MESSAGE_TYPES, PROTOCOL_VERSION, decode, encode
from kvpipe.transfer.planning.layout import KVLayout
from tests.helpers.wire_maps import key_paths

# bounded: the whole file runs in seconds on a shared 2-core machine
FUZZ = settings(
    max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
KINDS = sorted(MESSAGE_TYPES)

WIRE_INTS = st.integers(0, (1 << 63) - 1)
# anything msgpack can carry, including the types the codec refuses for a field (bytes for a
# str, bool for an int, negative and 64-bit-unsigned ints, nested containers)
MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    """KVLayouts that satisfy their own invariants (the codec rebuilds them through __post_init__)."""
    num_layers, page_size = draw(st.integers(1, 4)), draw(st.integers(1, 64))
    total = draw(st.integers(1, 8))
    head_start = draw(st.integers(0, total - 1))
    kv_heads = draw(st.integers(1, total - head_start))
    head_dim, itemsize = draw(st.integers(1, 128)), draw(st.sampled_from([1, 2, 4]))
    pages = draw(st.integers(0, 1000))
    addrs = draw(st.lists(WIRE_INTS, min_size=2 * num_layers, max_size=2 * num_layers))
    return KVLayout(
        num_layers,
        page_size,
        kv_heads,
        head_start,
        total,
        head_dim,
        draw(st.text(max_size=10)),
        itemsize,
        tuple(addrs),
        pages * kv_heads * page_size * head_dim * itemsize,
    )


def strategy_for(tp: Any) -> st.SearchStrategy:
    """Valid wire values of one field type, by the codec's own rules (codec.py docstring)."""
    inner = _optional_inner(tp)
    if inner is not None:
        return st.none() | strategy_for(inner)
    if tp is KVLayout:
        return layouts()
    if tp is int:
        return WIRE_INTS
    if tp is float:
        return st.floats(allow_nan=False)  # NaN != NaN would fail the equality, not the codec
    if tp is str:
        return st.text(max_size=30)
    if tp is bool:
        return st.booleans()
    if tp is bytes:  # raw bytes (AuxData.hidden)
        return st.binary(max_size=64)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if _is_int_tuple(tp):
        return st.lists(WIRE_INTS, max_size=50).map(tuple)
    if dataclasses.is_dataclass(tp):
        return messages_of(tp)
    raise AssertionError(f"no strategy for {tp!r}: extend strategy_for with the new field type")


@st.composite
def messages_of(draw: st.DrawFn, cls: type) -> Any:
    hints = _hints(cls)
    kwargs = {f.name: draw(strategy_for(hints[f.name])) for f in dataclasses.fields(cls)}
    try:
        return cls(**kwargs)
    except ValueError:  # the class's own invariant (TransferStatus SUCCESS needs aux)
        assume(False)


any_message = st.sampled_from(KINDS).flatmap(lambda k: messages_of(MESSAGE_TYPES[k]))


def _decode_or_protocol_error(data: bytes) -> Any:
    """decode's contract: a message of a known kind, or ProtocolError; anything else fails the test."""
    try:
        msg = decode(data)
    except ProtocolError:
        return None
    assert type(msg) in MESSAGE_TYPES.values()
    assert decode(encode(msg)) == msg  # whatever it accepted, it can say again
    return msg


# each example draws all nine kinds, and one drawn against its class's invariant (a SUCCESS status
# without aux, window pages not aligned with the pages) discards the example: many are filtered
@settings(FUZZ, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_every_kind_round_trips(data: st.DataObject) -> None:
    for kind in KINDS:  # every kind in every example, so none is left to chance
        msg = data.draw(messages_of(MESSAGE_TYPES[kind]), label=kind)
        out = decode(encode(msg))
        assert out == msg and type(out) is type(msg)


@FUZZ
@given(st.binary(max_size=300))
def test_garbage_bytes(data: bytes) -> None:
    _decode_or_protocol_error(data)


@FUZZ
@given(MSGPACK_VALUES)
def test_any_msgpack_value(value: Any) -> None:
    _decode_or_protocol_error(msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(st.sampled_from(KINDS), st.dictionaries(st.text(max_size=12), MSGPACK_VALUES, max_size=8))
def test_any_map_of_a_known_kind(kind: str, fields: dict[str, Any]) -> None:
    _decode_or_protocol_error(msgpack.packb({**fields, "kind": kind, "version": PROTOCOL_VERSION}, use_bin_type=True))


@FUZZ
@given(any_message, st.data())
def test_a_valid_message_with_one_field_broken(msg: Any, data: st.DataObject) -> None:
    """The nastiest garbage: right kind and version, every field fine but one."""
    wire = msgpack.unpackb(encode(msg), raw=False)
    path = data.draw(st.sampled_from([p for p in key_paths(wire) if p[0] not in ("kind", "version")] or [("kind",)]))
    parent = wire
    for k in path[:-1]:
        parent = parent[k]
    how = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if how == "replace":
        parent[path[-1]] = data.draw(MSGPACK_VALUES)
    elif how == "delete":
        del parent[path[-1]]
    else:
        parent[data.draw(st.text(min_size=1, max_size=8))] = data.draw(MSGPACK_VALUES)
    _decode_or_protocol_error(msgpack.packb(wire, use_bin_type=True))


@FUZZ
@given(any_message, st.integers(0, 400), st.binary(min_size=1, max_size=4))
def test_a_valid_message_truncated_or_corrupted(msg: Any, at: int, junk: bytes) -> None:
    raw = encode(msg)
    at %= len(raw)
    _decode_or_protocol_error(raw[:at])
    _decode_or_protocol_error(raw[:at] + junk + raw[at + len(junk) :])


def test_strategies_cover_every_field_type() -> None:
    """A new message or field type must get a strategy here, or the properties above miss it."""
    for cls in MESSAGE_TYPES.values():
        for name, tp in typing.get_type_hints(cls).items():
            if name != "KIND":
                strategy_for(tp)


# ---- the decoding limits (issue 30): sound for every real message, tight for anything else ------
MAX_INTS = 50  # the strategies' longest int list (strategy_for: lists of max_size 50)
ROLES = {
    "sender": m.SENDER_RECEIVES,
    "receiver": m.RECEIVER_RECEIVES,
    "staging agent": m.STAGING_AGENT_RECEIVES,
}


def _roles_of(cls: type) -> list[str]:
    return [role for role, kinds in ROLES.items() if cls in kinds]


def test_every_kind_is_received_by_some_endpoint() -> None:
    assert set(MESSAGE_TYPES.values()) == {c for kinds in ROLES.values() for c in kinds}


@pytest.mark.parametrize("kind", KINDS)
@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_real_messages_fit_their_receivers_limits(kind: str, data: st.DataObject) -> None:
    """The frame bound and the max_*_len limits derived from the classes never refuse a generated
    message whose int lists are within the bound (test_control_limits.py: the longest strings)."""
    cls = MESSAGE_TYPES[kind]
    msg = data.draw(messages_of(cls), label=kind)
    raw = encode(msg)
    for role in _roles_of(cls):
        limits = m.limits_for(ROLES[role], MAX_INTS)
        assert len(raw) <= limits.max_frame_bytes
        assert decode(raw, limits) == msg


@FUZZ
@given(st.sampled_from(sorted(ROLES)), MSGPACK_VALUES)
def test_any_msgpack_value_under_an_endpoints_limits(role: str, value: Any) -> None:
    limits = m.limits_for(ROLES[role], MAX_INTS)
    try:
        msg = decode(msgpack.packb(value, use_bin_type=True), limits)
    except ProtocolError:
        return
    assert type(msg) in ROLES[role] or type(msg) in MESSAGE_TYPES.values()


@FUZZ
@given(st.integers(MAX_INTS + 1, 4 * MAX_INTS), st.sampled_from(["dst_pages", "swa"]))
def test_an_int_list_past_the_bound_is_refused(n: int, which: str) -> None:
    pages = tuple(range(n))
    msg = (
        m.TransferRequest(1, "d/0", pages, 0, 0)
        if which == "dst_pages"
        else m.TransferRequest(1, "d/0", (0,) * n, 0, 0, None, (-1,) * n)
    )
    with pytest.raises(ProtocolError):
        decode(encode(msg), m.limits_for(m.SENDER_RECEIVES, MAX_INTS))


@FUZZ
@given(st.integers(1, 6), st.integers(0, 3))
def test_nested_containers_are_refused_whatever_their_shape(depth: int, width: int) -> None:
    """Arrays anywhere, or more maps than the widest message has, are refused while unpacking."""
    inner: Any = [[]] * width
    for _ in range(depth):
        inner = {"k": inner, "j": {}}
    frame = msgpack.packb({"kind": "heartbeat", "version": PROTOCOL_VERSION, "session_id": "s", "seq": inner})
    with pytest.raises(ProtocolError):
        decode(frame, m.limits_for(m.RECEIVER_RECEIVES, 0))
