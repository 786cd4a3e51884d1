"""Dataclass <-> msgpack-ready dict with strict validation, for the control-plane messages.

Rules (they keep validation generic and vectorised):
- int fields are non-negative and below 2**63 (ids, counts, ranks, rooms); bool is not an int;
- float fields accept ints; str, bool and Enum (by value) fields are exact;
- tuple[int, ...] fields travel as raw little-endian int64 bytes (page lists: no per-page
  Python work on either side); their entries are non-negative unless the field's metadata is
  NO_PAGE_OK (-1 entries allowed: "no page here");
- nested dataclasses travel as maps; `X | None` accepts None;
- a map must hold exactly the dataclass's fields (no missing, no unknown ones);
- str fields whose metadata is TEXT (free-text reasons) are cut to MAX_TEXT_CHARS when encoded;
- bytes fields travel as msgpack bin, as they are (raw tensors: a NEXTN prefill's hidden state),
  bounded like an int list (max_bin_len).
Anything else raises ProtocolError, including a dataclass's own __post_init__ ValueError.

`WireLimits` bounds what decoding a frame may allocate. The wire form above has no msgpack arrays
at all, a known number of maps per message, and strings and int64 lists only where the message
classes put them, so the limits follow from the classes an endpoint receives and from the largest
int list it can legitimately get (a page list: the pages of a pool). The frame size bound is the
largest encoding of those classes under those limits: a bigger frame is refused by the socket
(ZMQ_MAXMSGSIZE) before it is copied or authenticated.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

_INT_MAX = 1 << 63
NO_PAGE_OK = {"min_id": -1}  # field metadata: an int tuple whose entries may be -1 (no page)
TEXT = {"text": True}  # field metadata: a free-text str (a reason), cut to MAX_TEXT_CHARS when sent
MAX_STR_BYTES = 4096  # any str on the wire: addresses, session ids, dtype names, reasons
MAX_TEXT_CHARS = MAX_STR_BYTES // 4  # UTF-8 takes at most 4 bytes a character
SHORT_BIN_BYTES = 64  # challenges and digests: every endpoint decodes a bin this long


class ProtocolError(Exception):
    """A control-plane message that is malformed, of an unknown kind or of another version."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_int_tuple(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple and typing.get_args(tp) == (int, Ellipsis)


def to_wire(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cls: type = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("text") and type(value) is str and len(value) > MAX_TEXT_CHARS:
            value = value[: MAX_TEXT_CHARS - 3] + "..."  # an error message must never make a frame the peer refuses
        out[f.name] = _value_to_wire(value, hints[f.name])
    return out


def _value_to_wire(value: Any, tp: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return to_wire(value)
    if _is_int_tuple(tp) or (_optional_inner(tp) is not None and _is_int_tuple(_optional_inner(tp))):
        return np.asarray(value, dtype="<i8").tobytes()
    return value


def _optional_inner(tp: Any) -> Any:
    """T for `T | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def from_wire(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(f"{path}: expected a map, got {type(data).__name__}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in data]
    unknown = [k for k in data if k not in names]
    if missing or unknown:
        raise ProtocolError(f"{path}: missing fields {missing}, unknown fields {unknown}")
    kwargs = {
        f.name: _value_from_wire(data[f.name], hints[f.name], f"{path}.{f.name}", f.metadata.get("min_id", 0))
        for f in dataclasses.fields(cls)
    }
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # the dataclass's own invariants
        raise ProtocolError(f"{path}: {e}") from None


def _value_from_wire(value: Any, tp: Any, path: str, min_id: int = 0) -> Any:
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else _value_from_wire(value, inner, path, min_id)
    if tp is int:
        if type(value) is not int or not 0 <= value < _INT_MAX:
            raise ProtocolError(f"{path}: expected an int in [0, 2**63), got {value!r:.80}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise ProtocolError(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp in (str, bool, bytes):
        if type(value) is not tp:
            raise ProtocolError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            raise ProtocolError(f"{path}: {value!r:.80} is not one of {[m.value for m in tp]}") from None
    if _is_int_tuple(tp):
        if type(value) is not bytes or len(value) % 8:
            raise ProtocolError(f"{path}: expected int64 bytes, got {type(value).__name__}")
        arr = np.frombuffer(value, dtype="<i8")
        if arr.size and arr.min() < min_id:
            raise ProtocolError(f"{path}: id {int(arr.min())} below {min_id}")
        return tuple(arr.tolist())
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_wire(tp, value, path)
    raise TypeError(f"{path}: codec does not support field type {tp!r}")  # a bug in a message class


# ---- decoding limits -----------------------------------------------------------------------------

_INT_BYTES = 9  # msgpack uint64 / float64: marker + 8 bytes
_HEADER_BYTES = 5  # str32 / bin32 / map32 marker + length


@dataclass(frozen=True)
class WireLimits:
    """What decoding one frame may allocate (msgpack's max_*_len), and the largest frame a legit
    peer can send under them. Build with `for_classes`."""

    max_bin_len: int  # bytes of one int64 list: 8 x the longest list
    max_str_len: int
    max_map_len: int  # fields of the widest message (+ kind and version)
    max_maps: int  # maps in one message: the message and its nested dataclasses
    max_frame_bytes: int  # the largest encoding of any accepted class under these limits

    @classmethod
    def for_classes(cls, classes: Iterable[type], max_ints: int) -> WireLimits:
        """Limits for an endpoint that receives `classes` (top-level messages, each encoded with
        two more keys, kind and version) whose int lists hold at most `max_ints` entries."""
        bin_len = max(8 * max_ints, SHORT_BIN_BYTES)
        sizes = [_bound(c, bin_len) for c in classes]
        if not sizes:
            raise ValueError("an endpoint receives at least one message class")
        kind_bytes = max(len(getattr(c, "KIND", "")) for c in classes) + _HEADER_BYTES
        # kind and version: their keys (short fixstr) and values
        extra = len("kind") + 1 + kind_bytes + len("version") + 1 + _INT_BYTES
        return cls(
            max_bin_len=bin_len,
            max_str_len=MAX_STR_BYTES,
            max_map_len=max(s.map_len for s in sizes) + 2,
            max_maps=max(s.maps for s in sizes),
            max_frame_bytes=max(s.nbytes for s in sizes) + extra,
        )

    @functools.cached_property
    def unpack_kwargs(self) -> dict[str, Any]:
        """msgpack.unpackb limits: no arrays (int lists travel as bytes), no ext types."""
        return {
            "max_bin_len": self.max_bin_len,
            "max_str_len": self.max_str_len,
            "max_array_len": 0,
            "max_map_len": self.max_map_len,
            "max_ext_len": 0,
        }


@dataclass(frozen=True)
class _Size:
    nbytes: int  # largest encoding
    map_len: int  # widest map inside (this one included)
    maps: int  # maps inside (this one included)


@functools.cache
def _bound(cls: type, bin_len: int) -> _Size:
    hints = _hints(cls)
    nbytes, map_len, maps = _HEADER_BYTES, len(dataclasses.fields(cls)), 1
    for f in dataclasses.fields(cls):
        tp = _optional_inner(hints[f.name]) or hints[f.name]
        nbytes += len(f.name.encode()) + _HEADER_BYTES
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            inner = _bound(tp, bin_len)
            nbytes, map_len, maps = nbytes + inner.nbytes, max(map_len, inner.map_len), maps + inner.maps
        elif _is_int_tuple(tp) or tp is bytes:
            nbytes += bin_len + _HEADER_BYTES
        elif tp is str:
            nbytes += MAX_STR_BYTES + _HEADER_BYTES
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            nbytes += max(len(str(m.value).encode()) for m in tp) + _HEADER_BYTES
        else:  # int, float, bool, None
            nbytes += _INT_BYTES
    return _Size(nbytes, map_len, maps)


# Below this a frame is decoded without MapCounter (a Python call per map): a map costs at least 3
# bytes and its dict about 200, so a smaller frame expands to at most ~1 MiB whatever its shape.
MAP_COUNT_FROM_BYTES = 16 << 10


class MapCounter:
    """msgpack object_pairs_hook: builds each map as a dict and refuses the (max_maps + 1)-th, so a
    frame of nested maps cannot make more objects than a real message has."""

    __slots__ = ("left",)

    def __init__(self, max_maps: int) -> None:
        self.left = max_maps

    def __call__(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        self.left -= 1
        if self.left < 0:
            raise ValueError("more maps than any message holds")
        return dict(pairs)
