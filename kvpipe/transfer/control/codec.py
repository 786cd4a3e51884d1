"""Dataclass <-> msgpack-ready dict with strict validation, for the control-plane messages.

Rules (they keep validation generic and vectorised):
- int fields are non-negative and below 2**63 (ids, counts, ranks, rooms); bool is not an int;
- float fields accept ints; str, bool and Enum (by value) fields are exact;
- tuple[int, ...] fields travel as raw little-endian int64 bytes (page lists: no per-page
  Python work on either side); their entries are non-negative unless the field's metadata is
  NO_PAGE_OK (-1 entries allowed: "no page here");
- nested dataclasses travel as maps; `X | None` accepts None;
- a map must hold exactly the dataclass's fields (no missing, no unknown ones).
Anything else raises ProtocolError, including a dataclass's own __post_init__ ValueError.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import numpy as np

_INT_MAX = 1 << 63
NO_PAGE_OK = {"min_id": -1}  # field metadata: an int tuple whose entries may be -1 (no page)


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
        out[f.name] = _value_to_wire(getattr(obj, f.name), hints[f.name])
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
    if tp in (str, bool):
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
