"""What an engine sees of the transfer layer: its two APIs as Protocols, and the plain types they use.

Light on purpose: nothing here imports zmq, Mooncake or the bootstrap HTTP stack, so an engine
can type against `KVSenderAPI` / `KVReceiverAPI` and import this module without a transfer
backend. The implementations are `KVSender` (sender/kv_sender.py, one per prefill TP rank) and
`KVReceiver` (receiver/kv_receiver.py, one per decode instance); tests/unit/test_transfer_types.py
checks that they match these Protocols member by member.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvpipe.transfer.control.messages import AuxData, AuxTuple, DecodeRank
from kvpipe.transfer.lifecycle import DuplicateRoomError, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.receiver.stats import ReceiverStats
from kvpipe.transfer.sender.stats import SenderStats, TransferTiming

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


class KVSenderAPI(Protocol):
    """A prefill rank's side (sender/kv_sender.py has the contract of every call)."""

    @property
    def control_address(self) -> str: ...

    @property
    def instance_id(self) -> str: ...  # shared by the ranks of one prefill instance, new on restart

    @property
    def stats(self) -> SenderStats: ...

    def add_room(self, room: int, src_pages: np.ndarray | list[int], state_slot: int | None = None) -> None: ...

    def send(
        self,
        room: int,
        token_start: int,
        token_end: int,
        layer_start: int = 0,
        layer_end: int | None = None,
        last: bool = False,
        aux: AuxTuple | None = None,
        src_pages: np.ndarray | list[int] | None = None,
        ready: Callable[[], bool] | None = None,
        state: bool = False,
    ) -> bool: ...

    def abort(self, room: int, reason: str = ...) -> None: ...

    def poll(self) -> list[tuple[int, TransferState, str]]: ...  # (room, Success | Failed, reason)

    def take_timings(self) -> list[TransferTiming]: ...

    def room_state(self, room: int) -> TransferState | None: ...

    def num_active_rooms(self) -> int: ...

    def close(self) -> None: ...


class KVReceiverAPI(Protocol):
    """A decode instance's side (receiver/kv_receiver.py has the contract of every call)."""

    @property
    def control_address(self) -> str: ...

    @property
    def tp_size(self) -> int: ...  # decode ranks: add_room takes one page list per rank

    @property
    def stats(self) -> ReceiverStats: ...

    def add_room(
        self,
        room: int,
        bootstrap_host: str,
        bootstrap_port: int | None,
        dst_pages: Sequence[np.ndarray] | np.ndarray | list[int],
        prefix_len: int = 0,
        aux_slot: int = 0,
        state_slot: int | None = None,
    ) -> None: ...

    def abort(self, room: int, reason: str = ...) -> None: ...

    def poll(self) -> list[tuple[int, TransferState, str, AuxData | None]]: ...  # (room, state, reason, aux)

    def room_state(self, room: int) -> TransferState | None: ...

    def num_active_rooms(self) -> int: ...

    def close(self) -> None: ...
