"""KV cache transfer from prefill to decode, one subpackage per role (its __init__ says more):

control/      the control plane: typed messages and their codec, the ZeroMQ endpoint, bootstrap, auth
planning/     which bytes go where: KV layouts, TP head mapping, coalesced write ops, wire-byte estimates
sender/       the prefill side: a KVSender per TP rank, its SenderBook, decode peers and rooms
receiver/     the decode side: a KVReceiver per instance, its ReceiverBook and rooms
staging/      heterogeneous TP: head slices gathered into chunks, the decode's staging ring and agent
recurrent/    hybrid models' recurrent state: the state pool's layout and its write ops
backends/     one-sided batched writes into a peer's registered memory: the backends' registry, local and Mooncake
api.py        what an engine sees: the KVSenderAPI / KVReceiverAPI Protocols and their plain types
lifecycle.py  the room state machine (TransferState, RoomRecord), deadlines, peer liveness

The package itself is light (no zmq, Mooncake or HTTP stack): it re-exports api.py, loaded on first
use so that importing a light submodule (the backends' registry, control/auth.py: what `kvpipe serve
--help` parses with) does not load api.py's numpy. KVSender and KVReceiver come from their own
modules (sender/kv_sender.py, receiver/kv_receiver.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    """api.py's names, imported when first asked for (PEP 562)."""
    if name in __all__:
        return getattr(importlib.import_module("kvpipe.transfer.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
