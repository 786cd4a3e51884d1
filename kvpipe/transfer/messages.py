"""Typed, versioned control-plane messages between prefill and decode ranks (msgpack on the wire).

Wire form: a msgpack map {"kind": <tag>, "version": PROTOCOL_VERSION, <fields>}; see codec.py
for the field rules. `decode` raises ProtocolError for anything malformed and nothing else.

Flow: decode rank -> prefill: RegisterPeer once per (decode rank, prefill rank), then a
TransferRequest per request; prefill -> decode: TransferStatus when the KV has landed (or
failed); either side: Abort; both: Heartbeat.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

import msgpack

from kvpipe.transfer.codec import ProtocolError, from_wire, to_wire
from kvpipe.transfer.layout import KVLayout

PROTOCOL_VERSION = 2  # 2: AuxData.cached_tokens
MAX_MESSAGE_BYTES = 64 << 20  # a page list of 8M pages; anything bigger is garbage


class WireState(enum.Enum):
    """Outcome carried by TransferStatus; not the room state machine (state.TransferState)."""

    SUCCESS = "success"
    FAILED = "failed"


class Side(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class RegisterPeer:
    """A decode rank introduces itself to a prefill rank (once per pair, again after a restart)."""

    KIND = "register_peer"
    session_id: str  # unique per decode process incarnation: a restart gets a new one
    tp_rank: int
    tp_size: int
    data_address: str  # the decode backend's address that prefill writes into
    control_address: str  # where prefill sends TransferStatus / Abort / Heartbeat
    layout: KVLayout  # decode's registered KV buffers and head range


@dataclass(frozen=True)
class TransferRequest:
    """Decode preallocated pages for `room` and asks prefill to fill them."""

    KIND = "transfer_request"
    room: int  # bootstrap_room: the request's 63-bit id shared by prefill and decode
    session_id: str
    dst_pages: tuple[int, ...]  # decode page of request page prefix_len // page_size + i
    prefix_len: int  # leading tokens decode already holds (page aligned); prefill sends the rest
    aux_slot: int  # decode's slot for the request's aux data


@dataclass(frozen=True)
class AuxData:
    """What travels with the KV besides pages (F8)."""

    room: int  # echo of the room whose KV was written; decode rejects a status for another room
    first_token_id: int
    first_token_logprob: float
    cached_tokens: int = 0  # prompt tokens the prefill took from its prefix cache (not computed)


# what the engine hands the sender with a room's last chunk: (first token id, its logprob) and
# optionally the prompt tokens the prefill took from its prefix cache
AuxTuple = tuple[int, float] | tuple[int, float, int]


@dataclass(frozen=True)
class TransferStatus:
    """Prefill's final word on a room: after SUCCESS or FAILED none of its writes can still land."""

    KIND = "transfer_status"
    room: int
    session_id: str  # the decode session the writes went to
    state: WireState
    reason: str = ""
    aux: AuxData | None = None  # required with SUCCESS

    def __post_init__(self) -> None:
        if self.state is WireState.SUCCESS and self.aux is None:
            raise ValueError("a successful transfer status carries aux data")

    def is_stale_for(self, room: int) -> bool:
        """True when this status, or the aux data written with the KV, belongs to another room."""
        return self.room != room or (self.aux is not None and self.aux.room != room)


@dataclass(frozen=True)
class Abort:
    KIND = "abort"
    room: int
    session_id: str
    side: Side  # who gave up
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    KIND = "heartbeat"
    session_id: str
    seq: int  # increases by one per beat; a gap or reset means the peer restarted


Message = Union[RegisterPeer, TransferRequest, TransferStatus, Abort, Heartbeat]
MESSAGE_TYPES: dict[str, type] = {c.KIND: c for c in (RegisterPeer, TransferRequest, TransferStatus, Abort, Heartbeat)}


def encode(msg: Message) -> bytes:
    kind = getattr(type(msg), "KIND", None)
    if MESSAGE_TYPES.get(kind) is not type(msg):
        raise TypeError(f"not a control-plane message: {type(msg).__name__}")
    return msgpack.packb({"kind": kind, "version": PROTOCOL_VERSION, **to_wire(msg)}, use_bin_type=True)


def decode(data: bytes) -> Message:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(f"not a msgpack message: {type(e).__name__}: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a map, got {type(obj).__name__}")
    body = dict(obj)
    kind, version = body.pop("kind", None), body.pop("version", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r:.40}, expected {PROTOCOL_VERSION}")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message kind {kind!r:.40}")
    return from_wire(MESSAGE_TYPES[kind], body, kind)
