"""Typed, versioned control-plane messages between prefill and decode ranks (msgpack on the wire).

Wire form: a msgpack map {"kind": <tag>, "version": PROTOCOL_VERSION, <fields>}; see codec.py
for the field rules. `decode` raises ProtocolError for anything malformed and nothing else.

Flow: decode rank -> prefill: RegisterPeer once per (decode rank, prefill rank); prefill ->
decode: RegisterReply (a challenge the decode sends back inside the RegisterPeer, then accepted or
refused; later maybe evicted), then a TransferRequest per request; prefill -> decode:
TransferStatus when the KV has landed (or failed); either side: Abort; both: Heartbeat.

Staged chunks (heterogeneous TP through a staging ring, staging/buffers.py): prefill rank -> the decode
rank's staging agent: StagingSlotRequest; agent -> prefill: StagingSlotGrant (a ring offset, or
refused); prefill writes the chunk there with one op, then StagingChunkWritten (scatter it into
these pages, or only release the slot); agent -> prefill: StagingChunkDone once scattered.

Who sent a frame (protocol 6): a frame names sessions, and every receiver checks them against what
it bound at registration. A decode rank's session is a fresh random id per prefill instance it
registers with (receiver/book.py), sent only to that prefill's ranks: TransferStatus and Abort name
it and the prefill session that sends them (`sender`, which the decode checks against the ranks the
bootstrap server listed for that instance and the TP rank pairs). A staging ring's agent has a
random session of its own (StagingInfo.session_id, in RegisterPeer); each staged chunk carries a
random `nonce` the prefill picked, echoed by the agent's grant and done and by the prefill's
announcement, so neither side acts on a frame about a chunk its sender never saw.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgpack

from kvpipe.transfer.control.codec import (
    MAP_COUNT_FROM_BYTES,
    NO_PAGE_OK,
    TEXT,
    MapCounter,
    ProtocolError,
    WireLimits,
    from_wire,
    to_wire,
)
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout

PROTOCOL_VERSION = 10  # 2: AuxData.cached_tokens; 3: staging ring messages, RegisterPeer.staging;
# 4: recurrent state (RegisterPeer.state, TransferRequest.state_slot); 5: sliding-window layers
# (KVLayout.swa_layers, TransferRequest.dst_swa_pages: the window pages the decode wants);
# 6: senders named (TransferStatus.sender, Abort.sender, StagingInfo.session_id, staging nonces);
# 7: a draft model's KV (RegisterPeer.draft, TransferRequest.dst_draft_pages, AuxData.draft_tokens)
# 8: NEXTN's draft inputs (AuxData.hidden: the target's last hidden state, disagg/mtp_transfer.py)
# 9: TransferRequest.dst_swa_pages may start before the decode's prefix (the prompt's last window
# reaching back into a decode-cached prefix whose window pages the decode lacks)
# 10: registrations answer a challenge (RegisterPeer.challenge, RegisterReply), rooms are claimed
# with their prompt's digest (TransferRequest.claim, Abort.claim: room_claim), end-to-end KV
# integrity (TransferRequest.integrity_key, TransferStatus.kv_digest: transfer/kv_digest.py)
MAX_MESSAGE_INTS = 1 << 20  # `decode` without limits: int lists of up to 1M entries (8 MiB)


class WireState(enum.Enum):
    """Outcome carried by TransferStatus; not the room state machine (lifecycle.TransferState)."""

    SUCCESS = "success"
    FAILED = "failed"


class Side(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class StagingInfo:
    """A decode rank's staging ring: where its agent listens and the registered pool it grants from."""

    control_address: str  # the rank's staging agent (its own control endpoint)
    pool_addr: int  # base address of the ring, registered with the rank's backend
    pool_nbytes: int
    session_id: str = ""  # the agent's session: its grants and dones must name it


@dataclass(frozen=True)
class DecodeRank:
    """One decode rank as its KVReceiver announces it to prefill ranks (RegisterPeer)."""

    layout: KVLayout  # this rank's pool (head range set for its TP rank)
    data_address: str  # its backend's address: where prefill writes
    staging: StagingInfo | None = None  # its staging ring, when it offers one
    state: StateLayout | None = None  # its recurrent-state pool (hybrid models)
    draft: KVLayout | None = None  # its draft model's KV pool (STANDALONE speculative decoding)


@dataclass(frozen=True)
class RegisterPeer:
    """A decode rank introduces itself to a prefill rank (once per pair, again after a restart).
    The prefill answers a registration without a valid `challenge` with RegisterReply(CHALLENGE)
    to `control_address`; the decode sends the same registration again with that challenge: a
    session belongs to whoever receives at its control address (sender/peers.py)."""

    KIND = "register_peer"
    session_id: str  # unique per decode process incarnation: a restart gets a new one
    tp_rank: int
    tp_size: int
    data_address: str  # the decode backend's address that prefill writes into
    control_address: str  # where prefill sends TransferStatus / Abort / Heartbeat
    layout: KVLayout  # decode's registered KV buffers and head range
    staging: StagingInfo | None = None  # None: this decode rank takes plain page writes only
    state: StateLayout | None = None  # a hybrid model's recurrent-state pool (None: KV only)
    # the draft model's KV pool (STANDALONE speculative decoding; None: no draft KV): its pages move
    # as the layers after the target's, the last layer group (disagg/draft_transfer.py)
    draft: KVLayout | None = None
    challenge: bytes = b""  # the prefill's RegisterReply.challenge, echoed (b"": the first try)


class RegisterState(enum.Enum):
    CHALLENGE = "challenge"  # send the registration again with RegisterReply.challenge
    ACCEPTED = "accepted"  # the session is registered: its requests are served
    REFUSED = "refused"  # not registered (reason); rooms waiting for it fail with the reason
    EVICTED = "evicted"  # the session was forgotten (idle, or room for another): register again


@dataclass(frozen=True)
class RegisterReply:
    """A prefill rank's answer to a RegisterPeer, at the registration's control address."""

    KIND = "register_reply"
    session_id: str  # the decode session
    sender: str  # the prefill rank's session
    state: RegisterState
    challenge: bytes = b""  # with CHALLENGE
    reason: str = field(default="", metadata=TEXT)


@dataclass(frozen=True)
class TransferRequest:
    """Decode preallocated pages for `room` and asks prefill to fill them."""

    KIND = "transfer_request"
    room: int  # bootstrap_room: the request's 63-bit id shared by prefill and decode
    session_id: str
    dst_pages: tuple[int, ...]  # decode page of request page prefix_len // page_size + i
    prefix_len: int  # leading tokens decode already holds (page aligned); prefill sends the rest
    aux_slot: int  # decode's slot for the request's aux data
    state_slot: int | None = None  # hybrid models: decode's state slot the prefill writes the final state into
    # sliding-window models (KVLayout.swa_layers): aligned with dst_pages at its end, the decode page
    # of the sliding layers for the same logical page, -1 where the decode wants none (outside its
    # window, or it holds that one); k more entries before them name logical pages
    # [prefix_len // page_size - k, prefix_len // page_size): the prompt's last window reaching back
    # into the decode's cached prefix, whose window pages there the decode may lack
    dst_swa_pages: tuple[int, ...] | None = field(default=None, metadata=NO_PAGE_OK)
    # the decode's draft-pool pages for the prompt's draft KV, logical page i holding tokens from
    # i * page_size (from 0, whatever prefix_len: the draft has no prefix cache); None: not wanted
    dst_draft_pages: tuple[int, ...] | None = None
    # room_claim(room, prompt): the decode was sent this request; a prefill that knows the room's
    # prompt serves only a claim that names it (b"": none; sender/claims.py)
    claim: bytes = b""
    # --disaggregation-kv-integrity: the key of the digest of the written KV the final status carries
    integrity_key: bytes = b""

    def __post_init__(self) -> None:
        if self.dst_swa_pages is not None:
            lead = len(self.dst_swa_pages) - len(self.dst_pages)
            if not 0 <= lead <= self.prefix_len:  # the sender checks lead <= prefix_len // page_size
                raise ValueError(
                    f"{len(self.dst_swa_pages)} sliding-window pages for {len(self.dst_pages)} pages "
                    f"after a {self.prefix_len}-token prefix"
                )
            if self.dst_swa_pages and min(self.dst_swa_pages) < -1:
                raise ValueError(f"sliding-window page {min(self.dst_swa_pages)}: -1 (none) or a page id")


@dataclass(frozen=True)
class AuxData:
    """What travels with the KV besides pages (F8)."""

    room: int  # echo of the room whose KV was written; decode rejects a status for another room
    first_token_id: int
    first_token_logprob: float
    cached_tokens: int = 0  # prompt tokens the prefill took from its prefix cache (not computed)
    draft_tokens: int = 0  # prompt tokens whose draft-model KV was written into the draft pages (0: none)
    # NEXTN (disagg/mtp_transfer.py): the target's hidden states (after its final norm) of the
    # prompt's last positions whose MTP KV the prefill did not compute, [rows, hidden] raw bytes
    # in the MTP layer's dtype (b"": none)
    hidden: bytes = b""


# what the engine hands the sender with a room's last chunk: (first token id, its logprob) and
# optionally the prompt tokens the prefill took from its prefix cache, and NEXTN's hidden states
AuxTuple = tuple[int, float] | tuple[int, float, int] | tuple[int, float, int, bytes]


@dataclass(frozen=True)
class TransferStatus:
    """Prefill's final word on a room: after SUCCESS or FAILED none of its writes can still land."""

    KIND = "transfer_status"
    room: int
    session_id: str  # the decode session the writes went to
    state: WireState
    reason: str = field(default="", metadata=TEXT)
    aux: AuxData | None = None  # required with SUCCESS
    sender: str = ""  # the prefill rank's session (f"{instance_id}/{rank}"): the decode checks the pair
    kv_digest: bytes = b""  # with SUCCESS, when the request named an integrity_key: kv_digest.py

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
    session_id: str  # the decode session (from a decode: the sender's own)
    side: Side  # who gave up
    reason: str = field(metadata=TEXT)
    sender: str = ""  # from a prefill: its session, checked like TransferStatus.sender
    claim: bytes = b""  # from a decode that never requested the room: its room_claim


@dataclass(frozen=True)
class Heartbeat:
    KIND = "heartbeat"
    session_id: str
    seq: int  # increases by one per beat; a gap or reset means the peer restarted


@dataclass(frozen=True)
class StagingSlotRequest:
    """A prefill rank asks a decode rank's staging agent for `nbytes` of its ring."""

    KIND = "staging_slot_request"
    room: int
    session_id: str  # the prefill rank's session
    chunk: int  # unique per prefill session: names the slot in every later message
    nbytes: int
    reply_address: str  # the prefill rank's control endpoint
    nonce: int = 0  # random per chunk: every later message about the chunk must echo it


@dataclass(frozen=True)
class StagingSlotGrant:
    """The agent's answer: a slot at `offset` of its ring, or refused (`reason`: oversized, closing)."""

    KIND = "staging_slot_grant"
    room: int
    chunk: int
    session_id: str  # the agent's session (StagingInfo.session_id)
    ok: bool
    offset: int = 0
    reason: str = field(default="", metadata=TEXT)
    nonce: int = 0  # the request's


@dataclass(frozen=True)
class StagingChunkWritten:
    """The chunk is in the slot: layers [layer_start, layer_end) x (K, V) x pages, each entry
    `slice_nbytes` bytes that go to byte `page_offset` of its decode page. scatter=False: the
    room failed, only free the slot (nothing is scattered, no StagingChunkDone follows)."""

    KIND = "staging_chunk_written"
    room: int
    chunk: int
    session_id: str  # the prefill rank's session
    reply_address: str
    scatter: bool
    dst_pages: tuple[int, ...] = ()
    page_offset: int = 0  # bytes into each decode page: the first moved head
    slice_nbytes: int = 0  # bytes per (layer, K/V, page)
    layer_start: int = 0
    layer_end: int = 0
    nonce: int = 0  # the request's: the agent acts only on the chunk it granted


@dataclass(frozen=True)
class StagingChunkDone:
    """The agent scattered the chunk into the pages (ok) or could not (reason); the slot is free.
    watermark_*: the ring's oldest live position after the free (for metrics and tests)."""

    KIND = "staging_chunk_done"
    room: int
    chunk: int
    session_id: str  # the agent's session
    ok: bool
    reason: str = field(default="", metadata=TEXT)
    watermark_round: int = 0
    watermark_offset: int = 0
    nonce: int = 0  # the request's


CLAIM_BYTES = 16


def room_claim(room: int, prompt: Sequence[int]) -> bytes:
    """What a decode proves it was sent the request for `room` with: a digest of the room and the
    prompt's token ids, which the prefill computes from its own copy of the request. A token
    holder who learnt a room id (from /debug, logs, a guess) but not the prompt cannot claim it."""
    h = hashlib.blake2b(digest_size=CLAIM_BYTES, person=b"kvpipe-claim")
    h.update(room.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(prompt)}q", *prompt))  # int64 little endian (twice numpy's speed on a list)
    return h.digest()


Message = (
    RegisterPeer
    | RegisterReply
    | TransferRequest
    | TransferStatus
    | Abort
    | Heartbeat
    | StagingSlotRequest
    | StagingSlotGrant
    | StagingChunkWritten
    | StagingChunkDone
)
MESSAGE_TYPES: dict[str, type] = {
    c.KIND: c
    for c in (
        RegisterPeer,
        RegisterReply,
        TransferRequest,
        TransferStatus,
        Abort,
        Heartbeat,
        StagingSlotRequest,
        StagingSlotGrant,
        StagingChunkWritten,
        StagingChunkDone,
    )
}


# what each kind of endpoint receives (their decoding limits follow from it: limits_for)
SENDER_RECEIVES = (RegisterPeer, TransferRequest, Abort, Heartbeat, StagingSlotGrant, StagingChunkDone)
RECEIVER_RECEIVES = (TransferStatus, Abort, Heartbeat, RegisterReply)
STAGING_AGENT_RECEIVES = (StagingSlotRequest, StagingChunkWritten)


def encode(msg: Message) -> bytes:
    kind = getattr(type(msg), "KIND", None)
    if kind is None or MESSAGE_TYPES.get(kind) is not type(msg):
        raise TypeError(f"not a control-plane message: {type(msg).__name__}")
    return msgpack.packb({"kind": kind, "version": PROTOCOL_VERSION, **to_wire(msg)}, use_bin_type=True)


def limits_for(kinds: Iterable[type], max_ints: int) -> WireLimits:
    """Decoding limits of an endpoint that receives these message classes, whose int lists (page
    lists, buffer addresses, layer indices) hold at most `max_ints` entries."""
    return WireLimits.for_classes(tuple(kinds), max(1, max_ints))


DEFAULT_LIMITS = limits_for(MESSAGE_TYPES.values(), MAX_MESSAGE_INTS)


def decode(data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """The message in `data`; ProtocolError for anything malformed or beyond `limits` (checked while
    unpacking: a frame that would expand into more than a real message's objects is refused
    before it does)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_frame_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {limits.max_frame_bytes}")
    hook = MapCounter(limits.max_maps) if len(data) >= MAP_COUNT_FROM_BYTES else None
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=hook, **limits.unpack_kwargs
        )
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
