"""Typed messages between a PD connector (rank 0) and the transfer worker of every TP rank.

rank 0 -> every rank, as ForwardSpec.connector_meta (run inside the rank's own forward):
    PrefillStep     rooms to start and the rows whose KV ships group by group
rank 0 -> every rank, between forwards (WorkerGroup.call / post):
    StartPrefill -> RankStarted   a KVSender per rank, registered with the bootstrap server
    StartDecode  -> RankStarted   the rank's pool registered with its own backend
    SendChunks                    KV of finished chunks (the last one with the first token)
    FailRooms                     rooms that failed on the prefill: tell their decodes
    AbortRooms                    rooms another rank failed: stop writing them
every rank -> rank 0 (WorkerGroup.reports):
    RankReport                    rooms its sender is done with, and its counters
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.control.handshake import Handshake
from kvpipe.transfer.control.messages import AuxTuple, StagingInfo
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.sender.stats import SenderStats, TransferTiming


@dataclass(frozen=True)
class StartPrefill:
    instance_id: str  # shared by all ranks of the instance, new on every start
    bootstrap: tuple[str, int]  # the bootstrap server every rank registers with
    handshake: Handshake | None = None  # the instance's, registered by every rank (decodes compare it)
    # the instance's own secret its ranks sign their bootstrap registrations with (bootstrap.py: only
    # this prefill registers its ranks, not any holder of the shared token); b"": the shared token
    registrar_key: bytes = b""


@dataclass(frozen=True)
class StartDecode:
    pass


@dataclass(frozen=True)
class RankStarted:
    rank: int
    layout: KVLayout  # this rank's pool (its head range)
    data_address: str  # its backend: where peers write
    control_address: str | None  # prefill: its KVSender's control endpoint
    staging: StagingInfo | None = None  # decode with a staging ring: its agent and pool
    state: StateLayout | None = None  # a hybrid model's recurrent-state pool on this rank
    draft: KVLayout | None = None  # the draft model's KV pool (STANDALONE speculative decoding, TP 1)

    def addresses(self) -> dict[str, object]:
        """Where this rank listens (/server_info's rank_addresses, named in its listeners table)."""
        staging = self.staging.control_address if self.staging is not None else None
        return {"rank": self.rank, "data": self.data_address, "control": self.control_address, "staging": staging}


@dataclass(frozen=True)
class RoomStart:
    room: int
    pages: np.ndarray  # int64 page table of the whole prompt (the same page ids on every rank)
    state_slot: int | None = None  # hybrid models: the request's state slot (the same on every rank)
    # sliding-window models: the sliding layers' page table so far (-1: slid out), like `pages`
    swa_pages: np.ndarray | None = None
    # STANDALONE speculative decoding: the draft model's pages of the whole prompt (None: no draft KV)
    draft_pages: np.ndarray | None = None
    claim: bytes | None = None  # messages.room_claim of the request: only its decode may claim the room


@dataclass(frozen=True)
class ChunkSend:
    """KV of prompt tokens [token_start, token_end) (and every token before) is in the pool."""

    room: int
    token_start: int
    token_end: int
    last: bool = False  # the prompt is complete: flush partial pages, then aux
    aux: AuxTuple | None = None  # with `last`: (first token id, its logprob, prefill cached tokens)
    # a grouped row of the prompt's last forward: each group's recurrent state is final after it
    state: bool = False
    # sliding-window models: the sliding layers' page table now (it grows by chunk, and entries
    # turn -1 as the window slides past; the pages the decode asks for never do before the end)
    swa_pages: np.ndarray | None = None


@dataclass(frozen=True)
class PrefillStep:
    """ForwardSpec.connector_meta of a prefill forward."""

    start: tuple[RoomStart, ...] = ()  # rooms whose first forward this is: add_room before it
    grouped: tuple[ChunkSend, ...] = ()  # rows sent after each layer group (layer pipelining)


@dataclass(frozen=True)
class SendChunks:
    sends: tuple[ChunkSend, ...]


@dataclass(frozen=True)
class FailRooms:
    rooms: tuple[tuple[int, str], ...]  # (room, reason); a room unknown to the sender is added empty


@dataclass(frozen=True)
class AbortRooms:
    rooms: tuple[tuple[int, str], ...]  # (room, reason)


@dataclass(frozen=True)
class RankReport:
    rank: int
    results: tuple[tuple[int, TransferState, str], ...]  # what the rank's KVSender.poll reported
    stats: SenderStats  # a snapshot of its counters
    timings: tuple[TransferTiming, ...] = ()  # link use of rooms that succeeded (rank 0 only)
