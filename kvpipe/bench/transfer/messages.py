"""The messages the two processes of `kvpipe bench transfer` exchange over their pipe, and the one
the prefill process reports to the parent with. Typed: a process that gets another message
than the one it waits for fails with ProtocolError instead of misreading a tuple.

Same-TP bench (procs.py): the decode announces its pool (DecodePool), then zeroes it
(ZeroPool -> PoolZeroed) and digests pages (DigestPages -> PagesDigest) when asked.
Heterogeneous-TP bench (tp.py): the decode's receivers are up (ReceiversReady), then it
adds rooms (AddRoom -> RoomAdded) and checks what landed (CheckRoom -> RoomChecked).
Both end with Quit from the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class ProtocolError(RuntimeError):
    """A process got a message it does not expect here."""


@dataclass(frozen=True)
class Quit:
    """The prefill is done: the decode closes its engines and exits."""


@dataclass(frozen=True)
class DecodePool:
    registration: bytes  # the decode's RegisterPeer, encoded as the control plane sends it
    raw_address: int  # its raw-transfer buffer (the raw patterns write there)


@dataclass(frozen=True)
class ZeroPool:
    """Zero every KV page and state slot, so the next write must land to verify."""


@dataclass(frozen=True)
class PoolZeroed:
    pass


@dataclass(frozen=True, eq=False)
class DigestPages:
    pages: np.ndarray  # the decode's full pages of the request
    window_table: np.ndarray | None  # its window table (sliding shapes), else None


@dataclass(frozen=True)
class PagesDigest:
    hexdigest: str


@dataclass(frozen=True)
class ReceiversReady:
    pass


@dataclass(frozen=True, eq=False)
class AddRoom:
    variant: str  # "same" (one rank, all heads) or a heterogeneous variant
    room: int
    bootstrap_port: int  # the prefill's bootstrap server of that variant
    pages: np.ndarray  # the decode pages the room's KV goes to (every rank the same)


@dataclass(frozen=True)
class RoomAdded:
    pass


@dataclass(frozen=True, eq=False)
class CheckRoom:
    room: int
    src_pages: np.ndarray  # the prefill pages whose KV every decode rank must now hold


@dataclass(frozen=True)
class RoomChecked:
    ok: bool  # the room succeeded and every decode rank holds its heads of the source pages


@dataclass(frozen=True)
class Report:
    """Prefill -> parent: the per-length results."""

    result: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """Prefill -> parent: why the bench stopped."""

    error: str


Message = (
    Quit
    | DecodePool
    | ZeroPool
    | PoolZeroed
    | DigestPages
    | PagesDigest
    | ReceiversReady
    | AddRoom
    | RoomAdded
    | CheckRoom
    | RoomChecked
    | Report
    | Failed
)
