"""What a room's plan is made of: the send calls it queues, its destinations (one decode rank each),
the write batches and staged chunks it plans, and the policy that chooses staging; plain data
(room.py plans them; kv_sender.py and staged_sends.py carry them out)."""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpipe.transfer.backends.base import BatchHandle
from kvpipe.transfer.control.messages import StagingInfo
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.staging.ring import Slot


class PlanError(ValueError):
    """A send call or request that cannot be planned (sizes inconsistent); fails the room."""


@dataclass(frozen=True)
class SendCall:
    token_start: int
    token_end: int
    layer_start: int  # KV buffers [layer_start, layer_end) (a hybrid model's full layers only: may be empty)
    layer_end: int
    last: bool
    # None: the KV is in memory already (CPU). Else polled before planning and this call and every
    # later one of the room wait until it returns True (e.g. `torch.cuda.Event.query` of an event
    # recorded after the layer group: the write waits for the group, never for the whole device).
    ready: Callable[[], bool] | None = field(default=None, compare=False)
    # linear layers [j0, j1) (state-pool indices) whose state is final: written with this call
    state_layers: tuple[int, int] = (0, 0)


@dataclass
class Destination:
    """One decode rank this prefill rank writes a room's KV into (from RegisterPeer + TransferRequest)."""

    session_id: str
    decode_rank: int
    control_address: str
    data_address: str
    layout: KVLayout
    dst_pages: np.ndarray  # [n] int64
    prefix_len: int
    heads: tuple[int, int] | None  # global KV heads to write; None: another prefill rank sends them
    cursor: np.ndarray  # [num_layers] int64 tokens planned per layer, starts at prefix_len
    staging: StagingInfo | None = None  # the decode rank's staging ring, if it offers one
    state_layout: StateLayout | None = None  # the decode rank's state pool (hybrid models)
    state_slot: int | None = None  # the decode's state slot for this room
    state_sent: np.ndarray | None = None  # [num_linear] bool: the layer's state is planned
    dst_swa_pages: np.ndarray | None = None  # [n] int64 aligned with dst_pages, -1: no sliding page wanted
    # the decode's draft pool and its pages for the prompt's draft KV from logical page 0 (None:
    # no draft KV wanted); cursor[num_layers:] are the draft layers' send cursors, from 0
    draft_layout: KVLayout | None = None
    dst_draft_pages: np.ndarray | None = None
    # global draft-model KV heads this prefill rank writes there (the target's rank pairing over the
    # draft's own heads); None: another prefill rank sends them (a replicated head)
    draft_heads: tuple[int, int] | None = None
    # [k] int64: window pages of logical pages [prefix_len // ps - k, prefix_len // ps), below the
    # decode's prefix (-1: not wanted); None: none wanted there
    dst_swa_lead: np.ndarray | None = None
    swa_lead_sent: np.ndarray | None = None  # [num_layers] bool: the layer's lead pages are planned
    claim: bytes = b""  # the request's room claim (claims.py)
    expected: int = 1  # destinations of its decode that pair with this prefill rank for the room
    integrity_key: bytes = b""  # the decode wants a digest of what we wrote (transfer/kv_digest.py)


@dataclass(frozen=True)
class StagingPolicy:
    """When and how big a prefill rank stages its sends (DisaggregationConfig.staging)."""

    mode: str  # "on": every head-sliced send; "auto": when planner.staging_pays says so
    chunk_nbytes: int  # largest chunk: a fraction of the smaller of both staging buffers
    local_nbytes: int  # the prefill's own staging buffer


class ChunkState(enum.Enum):
    NEW = "new"  # planned: waits for local staging space
    GATHERING = "gathering"  # local slot held, the worker gathers the slices into it
    WAIT_SLOT = "wait_slot"  # gathered, a slot asked from the decode rank's agent
    GRANTED = "granted"  # slot known: the write may be submitted
    WRITING = "writing"  # the one write is in flight
    WAIT_DONE = "wait_done"  # written and announced: the agent scatters it into the pages


@dataclass
class StagedChunk:
    """Layers [l0, l1) x (K, V) x pages of one destination, bytes [col, col + ncols) of each page."""

    chunk: int  # id on the wire, unique per prefill session
    dest: str  # decode session
    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_col: int
    dst_col: int
    ncols: int
    l0: int
    l1: int
    state: ChunkState = ChunkState.NEW
    since: float = 0.0  # when it entered its current state
    local: Slot | None = None  # prefill staging bytes
    offset: int | None = None  # decode ring offset once granted
    # random: the agent's grant and done, and our announcement, must echo it (messages.py)
    nonce: int = field(default_factory=lambda: secrets.randbits(63))

    @property
    def nbytes(self) -> int:
        return (self.l1 - self.l0) * 2 * int(self.src_pages.size) * self.ncols


@dataclass
class Inflight:
    handle: BatchHandle
    submitted_at: float  # manager clock
    cancelled: bool = False
    chunk: StagedChunk | None = None  # the staged chunk this one write carries


@dataclass
class OpBatch:
    peer: str  # the destination's data-plane address
    src: np.ndarray  # [ops] int64 addresses
    dst: np.ndarray
    length: np.ndarray
    chunk: StagedChunk | None = None

    @property
    def num_ops(self) -> int:
        return int(self.length.size)


def equal_runs(values: np.ndarray, start: int, end: int) -> list[tuple[int, int, int]]:
    """Maximal runs [l0, l1) of equal values inside [start, end): (l0, l1, value)."""
    if start >= end:
        return []
    seg = values[start:end]
    cuts = np.flatnonzero(np.diff(seg)) + 1
    bounds = np.concatenate(([0], cuts, [seg.size])) + start
    return [(int(a), int(b), int(values[a])) for a, b in zip(bounds[:-1], bounds[1:])]
