"""Control-plane messages: round trips, and every malformed input raises ProtocolError."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvpipe.transfer.control.messages import (
    PROTOCOL_VERSION,
    Abort,
    AuxData,
    Heartbeat,
    ProtocolError,
    RegisterPeer,
    Side,
    StagingChunkDone,
    StagingChunkWritten,
    StagingInfo,
    StagingSlotGrant,
    StagingSlotRequest,
    TransferRequest,
    TransferStatus,
    WireState,
    decode,
    encode,
)
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout

LAYOUT = KVLayout(
    num_layers=2,
    page_size=16,
    kv_heads=2,
    head_start=2,
    total_kv_heads=4,
    head_dim=64,
    dtype="bfloat16",
    itemsize=2,
    buffer_addrs=(0x7F0000001000, 0x7F0000101000, 0x7F0000201000, 0x7F0000301000),
    buffer_nbytes=16 * 2 * 16 * 64 * 2,
)
ROOM = (1 << 63) - 5
STATE = StateLayout(
    num_model_layers=4,
    kv_layers=(3,),
    linear_layers=(0, 1, 2),
    num_slots=8,
    conv_dim=96,
    conv_len=3,
    heads=2,
    key_dim=16,
    value_dim=16,
    conv_dtype="bfloat16",
    conv_itemsize=2,
    conv_addrs=(0x7E0000000000, 0x7E0000100000, 0x7E0000200000),
    recurrent_addrs=(0x7E0000300000, 0x7E0000400000, 0x7E0000500000),
)

MESSAGES = [
    RegisterPeer("decode-0-abc", 1, 2, "10.0.0.2:15000", "tcp://10.0.0.2:5555", LAYOUT),
    TransferRequest(ROOM, "decode-0-abc", tuple(range(100, 164)), 32, 3),
    TransferRequest(0, "s", (), 0, 0),
    TransferStatus(ROOM, "decode-0-abc", WireState.SUCCESS, aux=AuxData(ROOM, 42, -0.25)),
    TransferStatus(7, "s", WireState.FAILED, reason="queue-full"),
    Abort(ROOM, "s", Side.PREFILL, "client disconnected"),
    Heartbeat("s", 12345),
    RegisterPeer(
        "d/1",
        1,
        2,
        "10.0.0.2:15000",
        "tcp://10.0.0.2:5555",
        LAYOUT,
        StagingInfo("tcp://10.0.0.2:5556", 0x7F0000401000, 64 << 20),
    ),
    StagingSlotRequest(ROOM, "p/0", 9, 1 << 20, "tcp://10.0.0.1:5555"),
    StagingSlotGrant(ROOM, 9, "d/1", True, 4096),
    StagingSlotGrant(ROOM, 9, "d/1", False, reason="larger than the ring"),
    StagingChunkWritten(ROOM, 9, "p/0", "tcp://10.0.0.1:5555", True, (5, 9, 2), 1024, 2048, 0, 2),
    StagingChunkWritten(ROOM, 9, "p/0", "tcp://10.0.0.1:5555", False),
    StagingChunkDone(ROOM, 9, "d/1", True, watermark_round=2, watermark_offset=512),
    RegisterPeer("d/0", 0, 1, "10.0.0.2:15000", "tcp://10.0.0.2:5555", LAYOUT, state=STATE),
    TransferRequest(ROOM, "d/0", (4, 5), 0, 0, state_slot=7),
    # NEXTN: the target's last hidden state as raw bytes (msgpack bin)
    TransferStatus(
        ROOM, "d/0", WireState.SUCCESS, aux=AuxData(ROOM, 42, -0.25, draft_tokens=40, hidden=bytes(range(16)))
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    out = decode(encode(msg))
    assert out == msg and type(out) is type(msg)


# TransferStatus as peers running this protocol version send it: renaming Python names must not
# change it (version 2 added AuxData.cached_tokens, version 3 the staging messages, version 4 the
# recurrent state: RegisterPeer.state, TransferRequest.state_slot; version 5 sliding-window pages;
# version 6 the sender's session: TransferStatus.sender; version 7 a draft model's KV:
# AuxData.draft_tokens, RegisterPeer.draft, TransferRequest.dst_draft_pages; version 8 NEXTN's
# AuxData.hidden, msgpack bin; version 9 window pages below the decode's prefix).
STATUS_BYTES = {
    "success": bytes.fromhex(
        "89a46b696e64af7472616e736665725f737461747573a776657273696f6e0aa4726f6f6d07aa73657373696f6e5f6964"
        "a3642f30a57374617465a773756363657373a6726561736f6ea0a361757886a4726f6f6d07ae66697273745f746f6b65"
        "6e5f69642ab366697273745f746f6b656e5f6c6f6770726f62cbbfd0000000000000ad6361636865645f746f6b656e73"
        "cc80ac64726166745f746f6b656e7300a668696464656ec400a673656e646572a3702f30a96b765f646967657374c400"
    ),
    "failed": bytes.fromhex(
        "89a46b696e64af7472616e736665725f737461747573a776657273696f6e0aa4726f6f6d07aa73657373696f6e5f6964"
        "a3642f30a57374617465a66661696c6564a6726561736f6eaa71756575652d66756c6ca3617578c0a673656e646572a3"
        "702f30a96b765f646967657374c400"
    ),
}


def test_transfer_status_bytes_are_unchanged():
    ok = TransferStatus(7, "d/0", WireState.SUCCESS, "", AuxData(7, 42, -0.25, 128), "p/0")
    failed = TransferStatus(7, "d/0", WireState.FAILED, "queue-full", sender="p/0")
    assert encode(ok) == STATUS_BYTES["success"] and decode(STATUS_BYTES["success"]) == ok
    assert encode(failed) == STATUS_BYTES["failed"] and decode(STATUS_BYTES["failed"]) == failed
    assert msgpack.unpackb(STATUS_BYTES["failed"])["state"] == "failed"


def test_a_peer_on_an_older_protocol_version_is_refused():
    """Version 1 peers send aux data without cached_tokens, version 2 ones know no staging ring,
    version 3 ones no recurrent state, version 4 ones no sliding-window pages, version 5 ones name
    no sender, version 6 ones know no draft KV, version 7 ones no NEXTN hidden state, version 8 ones
    send no window pages below the decode's prefix, version 9 ones answer no registration challenge
    and claim no room: all are refused by version, not misread."""
    v1 = msgpack.unpackb(STATUS_BYTES["success"])
    v1["version"] = 1
    del v1["aux"]["cached_tokens"]
    with pytest.raises(ProtocolError, match="protocol version 1, expected 10"):
        decode(msgpack.packb(v1))
    for old in (2, 3, 4, 5, 6, 7, 8, 9):
        v1["version"] = old
        with pytest.raises(ProtocolError, match=f"protocol version {old}, expected 10"):
            decode(msgpack.packb(v1))


def test_stale_room_detection():
    st = TransferStatus(5, "s", WireState.SUCCESS, aux=AuxData(6, 1, 0.0))
    assert st.is_stale_for(5) and st.is_stale_for(6)
    assert not TransferStatus(5, "s", WireState.SUCCESS, aux=AuxData(5, 1, 0.0)).is_stale_for(5)


def raw(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def good_fields(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


BAD = {
    "empty": b"",
    "not msgpack": b"\xc1\xc1\xc1",
    "trailing bytes": encode(MESSAGES[-1]) + b"\x00",
    "a list": msgpack.packb([1, 2, 3]),
    "an int": msgpack.packb(5),
    "no kind": raw(version=PROTOCOL_VERSION, session_id="s", seq=1),
    "unknown kind": raw(kind="nope", version=PROTOCOL_VERSION),
    "kind not str": raw(kind=5, version=PROTOCOL_VERSION),
    "wrong version": raw(kind="heartbeat", version=PROTOCOL_VERSION + 1, session_id="s", seq=1),
    "version as str": raw(kind="heartbeat", version="1", session_id="s", seq=1),
    "missing field": raw(kind="heartbeat", version=PROTOCOL_VERSION, session_id="s"),
    "unknown field": raw(kind="heartbeat", version=PROTOCOL_VERSION, session_id="s", seq=1, x=2),
    "negative seq": raw(kind="heartbeat", version=PROTOCOL_VERSION, session_id="s", seq=-1),
    "bool seq": raw(kind="heartbeat", version=PROTOCOL_VERSION, session_id="s", seq=True),
    "float seq": raw(kind="heartbeat", version=PROTOCOL_VERSION, session_id="s", seq=1.0),
    "huge room": raw(kind="abort", version=PROTOCOL_VERSION, room=1 << 63, session_id="s", side="decode", reason=""),
    "bad enum": raw(kind="abort", version=PROTOCOL_VERSION, room=1, session_id="s", side="router", reason=""),
    "str is bytes": raw(kind="heartbeat", version=PROTOCOL_VERSION, session_id=b"s", seq=1),
    "bytes is str": raw(
        kind="transfer_status",
        version=PROTOCOL_VERSION,
        room=1,
        session_id="s",
        state="success",
        reason="",
        aux=dict(room=1, first_token_id=2, first_token_logprob=0.0, cached_tokens=0, draft_tokens=0, hidden="h"),
        sender="",
    ),
    "bad utf8": b"\x82\xa4kind\xa9heartbeat\xa7version\xa2\xff\xfe",
    "int key": msgpack.packb({1: 2}),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_raises_protocol_error(name):
    with pytest.raises(ProtocolError):
        decode(BAD[name])


def mutated(msg, **changes) -> bytes:
    fields = good_fields(msg)
    fields.update(changes)
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    "changes",
    [
        {"dst_pages": [1, 2, 3]},  # a list, not int64 bytes
        {"dst_pages": b"\x00" * 7},  # not a whole number of int64
        {"dst_pages": (-1).to_bytes(8, "little", signed=True)},  # negative page id
        {"prefix_len": -16},
        {"room": "5"},
        {"aux_slot": None},
    ],
)
def test_bad_transfer_request_fields(changes):
    with pytest.raises(ProtocolError):
        decode(mutated(MESSAGES[1], **changes))


def test_bad_nested_layout_and_status():
    layout = good_fields(MESSAGES[0])["layout"]
    for bad in (
        {**layout, "kv_heads": 0},
        {**layout, "buffer_addrs": b"\x01" * 8},
        {**layout, "extra": 1},
        {**layout, "head_start": 3},
        "layout",
    ):
        with pytest.raises(ProtocolError):
            decode(mutated(MESSAGES[0], layout=bad))
    with pytest.raises(ProtocolError, match="aux"):
        decode(mutated(MESSAGES[4], state="success"))  # success without aux data
    with pytest.raises(ProtocolError):
        decode(mutated(MESSAGES[3], aux={"room": 1, "first_token_id": 2}))
    with pytest.raises(ProtocolError):
        decode(mutated(MESSAGES[3], aux={"room": 1, "first_token_id": 2, "first_token_logprob": "x"}))


def test_random_bytes_and_truncations_only_raise_protocol_error():
    rng = random.Random(0)
    blobs = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(500)]
    for msg in MESSAGES:
        data = encode(msg)
        blobs += [data[:i] for i in range(len(data))]
        for _ in range(50):  # single-byte corruptions
            i = rng.randrange(len(data))
            blobs.append(data[:i] + bytes([rng.randrange(256)]) + data[i + 1 :])
    for blob in blobs:
        try:
            decode(blob)
        except ProtocolError:
            pass  # anything else propagates and fails the test


def test_non_bytes_and_encode_of_foreign_objects():
    with pytest.raises(ProtocolError):
        decode("heartbeat")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode(LAYOUT)  # type: ignore[arg-type]
