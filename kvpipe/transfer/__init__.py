"""KV cache transfer from prefill to decode: layouts, planner, control plane, backends, sender, receiver.

The package itself is light (no zmq, Mooncake or HTTP stack): it re-exports api.py, the
engine-facing Protocols and plain types. KVSender and KVReceiver come from their own modules.
"""

from kvpipe.transfer.api import (
    AuxData,
    DecodeRank,
    DuplicateRoomError,
    KVLayout,
    KVReceiverAPI,
    KVSenderAPI,
    ReceiverStats,
    SenderStats,
    TransferState,
    TransferTiming,
)

__all__ = [
    "AuxData",
    "DecodeRank",
    "DuplicateRoomError",
    "KVLayout",
    "KVReceiverAPI",
    "KVSenderAPI",
    "ReceiverStats",
    "SenderStats",
    "TransferState",
    "TransferTiming",
]
