"""Decode-side bookkeeping of one room: which final statuses are due, aux data, when pages are safe.

Plain Python for `ReceiverBook`. Per decode rank r the room expects one final TransferStatus
(naming r's session and, as sender, the prefill rank) from each prefill rank of
`source_ranks(r, P, D)` (r // (D/P) when D >= P, else ranks r*P/D to
(r+1)*P/D - 1; prefill ranks whose heads another rank already sends still answer, without
writing). A prefill rank sends exactly one final status per (room, decode session), and only
once none of its writes for the room can still land. So the room is
- Success when every expected status is SUCCESS and the aux data echoes this room;
- quiet (its pages may be reused) when nothing was requested yet, every expected final status
  arrived, the prefill restarted, or `quiet_deadline` (failure time + transfer_timeout_s) passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from kvpipe.transfer.control.bootstrap_address import BootstrapAddress
from kvpipe.transfer.control.messages import AuxData, TransferStatus, WireState
from kvpipe.transfer.lifecycle import RoomRecord, TransferState
from kvpipe.transfer.planning.tp_mapping import source_ranks


def rank_pairs(prefill_tp: int, decode_tp: int) -> list[tuple[int, int]]:
    """(prefill rank, decode rank) pairs that exchange a TransferRequest and a final status."""
    return [(p, r) for r in range(decode_tp) for p in source_ranks(r, prefill_tp, decode_tp)]


def merge_aux(held: AuxData | None, new: AuxData | None) -> tuple[AuxData | None, str | None]:
    """The room's aux data after one more prefill rank's: (merged, None), or (held, what the two
    disagree on). Every rank's must agree on the target's fields (first token, its logprob,
    cached tokens). The draft fields (draft_tokens, hidden) come from the ranks that hold draft
    state: every rank with a STANDALONE draft model's shard, rank 0 alone with NEXTN's MTP layer
    (disagg/mtp_transfer.py), whose other ranks send none (0 and b""); those that send some agree."""
    if held is None or new is None:
        return (new if held is None else held), None
    if replace(new, draft_tokens=0, hidden=b"") != replace(held, draft_tokens=0, hidden=b""):
        return held, "the first token"
    if new.draft_tokens == 0 and not new.hidden:
        return held, None
    if held.draft_tokens == 0 and not held.hidden:
        return new, None
    return held, (None if new == held else "the draft state (draft tokens, hidden state)")


@dataclass
class ReceiverRoom:
    room: int
    rec: RoomRecord
    prefill: BootstrapAddress  # bootstrap host, port
    dst_pages: tuple[np.ndarray, ...]  # per decode rank: pages for tokens from prefix_len on
    prefix_len: int
    aux_slot: int = 0
    state_slot: int | None = None  # hybrid models: the request's state slot on every decode rank
    instance_id: str | None = None  # prefill instance the request went to
    # sliding-window models: per decode rank, aligned with dst_pages at its end (entries before them:
    # logical pages below prefix_len), -1 where no window page is wanted
    swa_pages: tuple[np.ndarray, ...] | None = None
    # STANDALONE speculative decoding: the draft pool's pages for the prompt's draft KV from token 0
    # (the same ids on every decode rank, each holding its shard of heads); None: no draft KV asked for
    draft_pages: np.ndarray | None = None
    claim: bytes = b""  # messages.room_claim of the request (the prefill serves only that claim)
    integrity_key: bytes = b""  # --disaggregation-kv-integrity: the key of the digests asked for
    # (decode rank, prefill rank) -> the digest of the KV that prefill rank wrote (its Success status)
    digests: dict[tuple[int, int], bytes] = field(default_factory=dict)
    prefill_tp: int = 0  # the TP size of the prefill instance it was requested from
    expected: dict[int, int] = field(default_factory=dict)  # decode rank -> final statuses due
    finals: dict[int, int] = field(default_factory=dict)
    successes: dict[int, int] = field(default_factory=dict)
    aux: AuxData | None = None
    requested: bool = False  # TransferRequests went out: prefill may be writing
    prefill_gone: bool = False  # the prefill instance restarted: nothing more of the old one can land
    aborts_sent: bool = False
    quiet_deadline: float | None = None
    sessions: tuple[str, ...] = ()  # per decode rank: the session the room was requested under
    # (prefill session f"{instance_id}/{p}", our session of rank r) -> (r, p): the pairs that answer
    senders: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    reported: set[tuple[int, int]] = field(default_factory=set)  # (decode rank, prefill rank) final statuses

    def requested_from(self, instance_id: str, prefill_tp: int, decode_tp: int, sessions: tuple[str, ...]) -> None:
        self.instance_id = instance_id
        self.prefill_tp = prefill_tp
        self.requested = True
        self.sessions = sessions
        self.expected = {r: 0 for r in range(decode_tp)}
        self.senders = {}
        for p, r in rank_pairs(prefill_tp, decode_tp):
            self.expected[r] += 1
            self.senders[(f"{instance_id}/{p}", sessions[r])] = (r, p)
        self.finals = dict.fromkeys(self.expected, 0)
        self.successes = dict.fromkeys(self.expected, 0)

    def pair_of(self, session: str, sender: str) -> tuple[int, int] | None:
        """(decode rank, prefill rank) of a status or abort naming our `session` and, as its
        sender, prefill session `sender`; None unless the room was requested that way."""
        return self.senders.get((sender, session))

    def on_status(self, decode_rank: int, prefill_rank: int, st: TransferStatus, now: float) -> str | None:
        """Apply a final status of a pair from pair_of; returns why it was rejected (then it
        changes nothing), or None."""
        if (decode_rank, prefill_rank) in self.reported:
            return f"a second final status from prefill rank {prefill_rank} for decode rank {decode_rank}"
        self.reported.add((decode_rank, prefill_rank))
        self.finals[decode_rank] += 1
        if st.state is WireState.FAILED:
            self.rec.fail(f"prefill failed the transfer: {st.reason}", now)
            return None
        if st.is_stale_for(self.room):
            self.rec.fail(
                f"stale transfer: aux data of room {st.aux.room if st.aux else None} arrived for room {self.room}", now
            )
            return None
        self.successes[decode_rank] += 1
        self.digests[(decode_rank, prefill_rank)] = st.kv_digest
        aux, why = merge_aux(self.aux, st.aux)
        if why is not None:
            self.rec.fail(f"prefill ranks disagree on {why}: {self.aux} vs {st.aux}", now)
            return None
        self.aux = aux
        if self.successes == self.expected:
            self.rec.move(TransferState.SUCCESS, now)
        else:
            self.rec.move(TransferState.TRANSFERRING, now)
        return None

    @property
    def all_final(self) -> bool:
        return bool(self.expected) and self.finals == self.expected

    def quiet(self, now: float) -> bool:
        """No write for this room can still land in its pages."""
        return (
            not self.requested
            or self.prefill_gone
            or self.all_final
            or (self.quiet_deadline is not None and now >= self.quiet_deadline)
        )
