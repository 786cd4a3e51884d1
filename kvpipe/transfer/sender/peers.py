"""Decode sessions known to one prefill rank: registration checks, TP pairing, request checks, liveness.

Plain bookkeeping for `KVSender` (called under its lock). A decode rank registers once per
session (RegisterPeer); a registration that cannot work (incompatible layout, TP sizes that do not
divide, a rank pair the mapping never uses) is remembered with its reason so that the session's
TransferRequests are answered with that reason instead of a silent timeout. Liveness is tracked
per decode control address: every message from any of its sessions is a sign of life.
"""

from __future__ import annotations

import logging

import numpy as np

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.control.messages import RegisterPeer, TransferRequest
from kvpipe.transfer.lifecycle import PeerLiveness
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range, slices_for_decode_rank, source_ranks
from kvpipe.transfer.planning.window_table import window_pages_problem
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.recurrent.plan import common_heads

log = logging.getLogger(__name__)


def expected_destinations(prefill_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """Decode ranks that pair with `prefill_rank` (tp_mapping.source_ranks): each sends it one TransferRequest."""
    return sum(prefill_rank in source_ranks(r, prefill_tp, decode_tp) for r in range(decode_tp))


class SenderPeers:
    def __init__(
        self,
        cfg: DisaggregationConfig,
        layout: KVLayout,
        tp_rank: int,
        tp_size: int,
        state_layout: StateLayout | None = None,
    ) -> None:
        self.layout, self.tp_rank, self.tp_size = layout, tp_rank, tp_size
        self.state_layout = state_layout
        self.peers: dict[str, RegisterPeer] = {}
        self.heads: dict[str, tuple[int, int] | None] = {}  # per session: heads we write, None = dummy pair
        self.rejected: dict[str, tuple[str, str]] = {}  # session -> (reason, control address)
        self.liveness = PeerLiveness[str](cfg.heartbeat_timeout_s)
        self._forget_after_s = 10 * cfg.heartbeat_timeout_s

    def register(self, msg: RegisterPeer, now: float) -> str | None:
        """Accept a decode rank's registration; returns why it was refused, or None."""
        reason = self._check(msg)
        if reason is not None:
            self.rejected[msg.session_id] = (reason, msg.control_address)
            while len(self.rejected) > 1024:  # bounded against a misbehaving peer
                del self.rejected[next(iter(self.rejected))]
            self.peers.pop(msg.session_id, None)
            return reason
        old = self.peers.get(msg.session_id)
        if old is not None and old != msg:
            log.warning("decode session %s re-registered with a different layout/address", msg.session_id)
        self.rejected.pop(msg.session_id, None)
        self.peers[msg.session_id] = msg
        self.heads[msg.session_id] = self._pair_heads(msg)
        self.liveness.seen(msg.control_address, now)
        return None

    def _check(self, msg: RegisterPeer) -> str | None:
        why = self.layout.compatible_with(msg.layout)
        if why:
            return f"decode rank {msg.tp_rank} layout incompatible with prefill rank {self.tp_rank}: {why}"
        if not 0 <= msg.tp_rank < msg.tp_size:
            return f"decode tp_rank {msg.tp_rank} outside tp_size {msg.tp_size}"
        why = self._check_state(msg)
        if why:
            return why
        try:
            heads = kv_head_range(msg.tp_size, msg.tp_rank, self.layout.total_kv_heads)
            if (msg.layout.head_start, msg.layout.head_end) != heads:
                return (
                    f"decode layout holds KV heads [{msg.layout.head_start}, {msg.layout.head_end}), "
                    f"TP {msg.tp_size} rank {msg.tp_rank} needs [{heads[0]}, {heads[1]})"
                )
            if self.tp_rank not in source_ranks(msg.tp_rank, self.tp_size, msg.tp_size):
                return (
                    f"prefill rank {self.tp_rank} (TP {self.tp_size}) never sends to decode rank "
                    f"{msg.tp_rank} (TP {msg.tp_size})"
                )
            self._pair_heads(msg)
        except ValueError as e:
            return f"TP {self.tp_size} -> {msg.tp_size}: {e}"
        return None

    def _check_state(self, msg: RegisterPeer) -> str | None:
        mine, theirs = self.state_layout, msg.state
        if mine is None and theirs is None:
            return None
        if mine is None or theirs is None:
            has = "prefill" if mine is not None else "decode"
            return f"only the {has} has a recurrent-state pool (a hybrid model on one side only)"
        why = mine.compatible_with(theirs)
        if why is None and common_heads(mine, theirs) is None:
            why = "no common linear-attention heads (the TP mapping pairs ranks that share heads)"
        return None if why is None else f"decode rank {msg.tp_rank}: {why}"

    def _pair_heads(self, msg: RegisterPeer) -> tuple[int, int] | None:
        for s in slices_for_decode_rank(msg.tp_rank, self.tp_size, msg.tp_size, self.layout.total_kv_heads):
            if s.prefill_rank == self.tp_rank:
                return s.head_start, s.head_end
        return None  # a replicated head another prefill rank already sends

    def check_request(self, msg: TransferRequest) -> tuple[RegisterPeer | None, str | None]:
        """(peer, None) for a valid request, else (peer or None, why it is refused)."""
        peer = self.peers.get(msg.session_id)
        if peer is None:
            rej = self.rejected.get(msg.session_id)
            return None, (rej[0] if rej else f"decode session {msg.session_id} is not registered")
        ps = self.layout.page_size
        if msg.prefix_len % ps:
            return peer, f"prefix_len {msg.prefix_len} is not a multiple of the page size {ps}"
        pages = np.asarray(msg.dst_pages, dtype=np.int64)
        if pages.size and pages.max() >= peer.layout.num_pages:
            return peer, f"destination page {int(pages.max())} outside the decode pool of {peer.layout.num_pages}"
        if np.unique(pages).size != pages.size:
            return peer, "duplicate destination pages"
        if (peer.state is None) != (msg.state_slot is None):
            return peer, (
                "a hybrid model's request needs a decode state slot"
                if msg.state_slot is None
                else "a state slot for a model without recurrent state"
            )
        if peer.state is not None and msg.state_slot is not None and msg.state_slot >= peer.state.num_slots:
            return peer, f"state slot {msg.state_slot} outside the decode pool of {peer.state.num_slots}"
        if bool(peer.layout.swa_layers) != (msg.dst_swa_pages is not None):
            return peer, (
                "a sliding-window model's request needs dst_swa_pages"
                if msg.dst_swa_pages is None
                else "dst_swa_pages for a model without sliding-window layers"
            )
        if msg.dst_swa_pages is not None:
            why = window_pages_problem(
                np.asarray(msg.dst_swa_pages, dtype=np.int64),
                peer.layout.num_pages,
                pages,
                exact=True,
                aliased=peer.layout.aliased,
            )
            if why is not None:
                return peer, why
        return peer, None

    def reply_address(self, session_id: str) -> str | None:
        peer = self.peers.get(session_id)
        if peer is not None:
            return peer.control_address
        rej = self.rejected.get(session_id)
        return rej[1] if rej else None

    def seen(self, session_id: str, now: float) -> None:
        addr = self.reply_address(session_id) if session_id in self.peers else None
        if addr is not None and self.liveness.seen(addr, now):
            log.info("decode at %s is alive again", addr)

    def control_addresses(self) -> set[str]:
        return {p.control_address for p in self.peers.values()}

    def prune(self, now: float, in_use: set[str]) -> list[str]:
        """Forget decodes dead for long with no room using them; returns their addresses."""
        gone = [
            a
            for a in list(self.liveness.dead)
            if a not in in_use and now - self.liveness.last_seen.get(a, now) > self._forget_after_s
        ]
        for a in gone:
            self.liveness.forget(a)
            for s in [s for s, p in self.peers.items() if p.control_address == a]:
                del self.peers[s]
                self.heads.pop(s, None)
        return gone
