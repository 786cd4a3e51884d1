"""Decode sessions known to one prefill rank: registration checks, TP pairing, request checks, liveness.

Plain bookkeeping for `KVSender` (called under its lock). A decode rank registers once per
session (RegisterPeer); a registration that cannot work (incompatible layout, TP sizes that do not
divide, a rank pair the mapping never uses) is remembered with its reason so that the session's
TransferRequests are answered with that reason instead of a silent timeout. Liveness is tracked
per decode control address: every message from any of its sessions is a sign of life.

A session is bound to its first registration (issue 30): the same session id with another
address, layout or ring is refused and the first stays. A data address is bound to what its
first live registrant said: while that decode (control address) is alive, another session may
name the data address only with the same control address, rank, buffers, ring and state pool (a
decode rank registering again), so nobody can point a prefill's writes at other offsets of a
decode's memory. The data address must be on the control address's host (when both are IP
literals) and not this prefill rank's own; buffers and ring may not overlap or start at 0. The
bootstrap server lists prefill ranks only, so these bindings, not a bootstrap record of the
decode, are what a RegisterPeer is checked against.

Sessions cannot be exhausted (issue 45, finding 3: 20 sessions from 127.0.0.N filled a table of
16 and the genuine decode's requests timed out). A session is registered only once its
registrant answered a challenge at the control address it named (challenge.py, SenderBook), so a
session belongs to an endpoint that receives there. Then:
- per endpoint (control address, decode rank) at most `max_sessions_per_endpoint`; at most
  `max_sessions` in all;
- past either bound the least recently used session that has no admitted room in flight (the
  `in_use` sessions the book names) is evicted for the newcomer, and told so (RegisterReply
  EVICTED: its decode registers again when it next needs this prefill, and asks again for any
  room it had asked for, whose claim the eviction dropped); only when every session is busy with
  admitted rooms is a registration refused. "Used" is a registration or a request bound to a room,
  not a heartbeat (which an idle squatter sends as cheaply as anyone);
- a session with no room for `session_idle_s` is evicted too, heartbeats or not; dead decodes are
  pruned as before.
What this cannot do with one shared token: a holder with many endpoints that registers again
faster than a genuine decode's registration round trip keeps evicting its idle sessions (its busy
ones are never touched); the decode then registers again before each request, which costs it a
round trip, not the request.
"""

from __future__ import annotations

import ipaddress
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
        own_data_address: str = "",
        draft_layout: KVLayout | None = None,
        draft_rank: int | None = None,
    ) -> None:
        """`draft_layout`: this rank's draft-model pool (STANDALONE speculative decoding): a decode
        must register one compatible with it, or none (then its requests name no draft pages).
        `draft_rank`: the one TP rank of each side that holds the draft KV whole (NEXTN's MTP
        layer, disagg/mtp_transfer.py: rank 0), None: every rank holds its shard of the draft's
        heads (STANDALONE). Then only that decode rank may register a draft pool, only that
        prefill rank has one, and it writes the whole pool into it; the other prefill ranks accept
        the registration and send no draft KV."""
        self.layout, self.tp_rank, self.tp_size = layout, tp_rank, tp_size
        self.draft_layout = draft_layout
        self.draft_rank = draft_rank
        self.own_data_address = own_data_address  # this rank's backend: never a destination
        self.max_sessions = cfg.limits.max_sessions
        self.max_per_endpoint = cfg.limits.max_sessions_per_endpoint
        self.idle_s = float(cfg.limits.session_idle_s)
        self.last_used: dict[str, float] = {}  # session -> its registration or last bound request
        self.evicted: list[RegisterPeer] = []  # sessions forgotten for others or idleness (the book tells them)
        self.state_layout = state_layout
        self.peers: dict[str, RegisterPeer] = {}
        self.heads: dict[str, tuple[int, int] | None] = {}  # per session: heads we write, None = dummy pair
        # per session registered with a draft pool: the draft model's heads we write (its own
        # head count, the same rank pairing), None: another prefill rank sends them
        self.draft_heads: dict[str, tuple[int, int] | None] = {}
        self.rejected: dict[str, tuple[str, str]] = {}  # session -> (reason, control address)
        self.liveness = PeerLiveness[str](cfg.heartbeat_timeout_s)
        self._forget_after_s = 10 * cfg.heartbeat_timeout_s

    def register(self, msg: RegisterPeer, now: float, in_use: frozenset[str] | set[str] = frozenset()) -> str | None:
        """Accept a decode rank's registration (its challenge answered: SenderBook); returns why it
        was refused, or None. `in_use`: sessions with admitted rooms in flight (never evicted)."""
        clash = self._binding_clash(msg)
        if clash is not None:  # the bound session (or the address's owner) stays as it was
            if msg.session_id not in self.peers:
                self._remember_rejected(msg, clash)
            return clash
        reason = self._check(msg)
        if reason is not None:
            self._remember_rejected(msg, reason)
            self.peers.pop(msg.session_id, None)
            return reason
        if msg.session_id not in self.peers:
            why = self._make_room(msg, in_use)
            if why is not None:
                return why
        self.rejected.pop(msg.session_id, None)
        self.last_used[msg.session_id] = now
        self.peers[msg.session_id] = msg
        self.heads[msg.session_id] = self._pair_heads(msg)
        if msg.draft is not None and self.draft_layout is not None:
            self.draft_heads[msg.session_id] = self._draft_heads(msg)
        self.liveness.seen(msg.control_address, now)
        return None

    def _make_room(self, msg: RegisterPeer, in_use: frozenset[str] | set[str]) -> str | None:
        """Evict what a new session needs evicted (module docstring), or say why it cannot be."""
        endpoint = (msg.control_address, msg.tp_rank)
        same = [s for s, p in self.peers.items() if (p.control_address, p.tp_rank) == endpoint]
        for pool, cap, what in (
            (same, self.max_per_endpoint, f"of the decode endpoint {msg.control_address} rank {msg.tp_rank}"),
            (list(self.peers), self.max_sessions, "in all"),
        ):
            if len(pool) < cap:
                continue
            idle = [s for s in pool if s not in in_use]
            if not idle:
                return (
                    f"{len(pool)} decode sessions {what} are registered with prefill rank {self.tp_rank} "
                    "and every one has rooms in flight"
                )
            self.evict(min(idle, key=lambda s: self.last_used.get(s, float("-inf"))))
        return None

    def evict(self, session: str) -> None:
        """Forget a session for another or for idleness; the book tells its decode (self.evicted)."""
        peer = self.peers.get(session)
        if peer is None:
            return
        self._forget_session(session)
        self.evicted.append(peer)
        if all(p.control_address != peer.control_address for p in self.peers.values()):
            self.liveness.forget(peer.control_address)

    def used(self, session: str, now: float) -> None:
        """A request of the session was bound to a room: it is in use (LRU order)."""
        if session in self.peers:
            self.last_used[session] = now

    def take_evicted(self) -> list[RegisterPeer]:
        out, self.evicted = self.evicted, []
        return out

    def _remember_rejected(self, msg: RegisterPeer, reason: str) -> None:
        """The session's requests are answered with `reason` (at its control address)."""
        self.rejected[msg.session_id] = (reason, msg.control_address)
        while len(self.rejected) > 1024:  # bounded against a misbehaving peer
            del self.rejected[next(iter(self.rejected))]

    def _forget_session(self, session: str) -> None:
        self.peers.pop(session, None)
        self.last_used.pop(session, None)
        self.heads.pop(session, None)
        self.draft_heads.pop(session, None)

    def _binding_clash(self, msg: RegisterPeer) -> str | None:
        """Why this registration would rebind a session or take another decode's memory, or None."""
        old = self.peers.get(msg.session_id)
        if old is not None and old != msg:
            return f"session {msg.session_id} is bound to its first registration (another address or layout now)"
        if msg.data_address == self.own_data_address:
            return f"data address {msg.data_address} is this prefill rank's own"
        mine = (msg.control_address, msg.tp_rank, msg.layout, msg.staging, msg.state, msg.draft)
        for p in self.peers.values():
            if (
                p.data_address == msg.data_address
                and (p.control_address, p.tp_rank, p.layout, p.staging, p.state, p.draft) != mine
                and self.liveness.alive(p.control_address)
            ):
                return (
                    f"data address {msg.data_address} is registered by the decode at {p.control_address} "
                    "with other buffers"
                )
        return None

    def _check_addresses(self, msg: RegisterPeer) -> str | None:
        """The data address on the control address's host; buffers and ring that do not overlap."""
        data_host, control_host = _host(msg.data_address), _host(msg.control_address.removeprefix("tcp://"))
        if (
            _is_ip(data_host)
            and _is_ip(control_host)
            and ipaddress.ip_address(data_host) != ipaddress.ip_address(control_host)
        ):
            return f"data address {msg.data_address} is not on the control address's host {control_host}"
        starts, sizes = msg.layout.unique_buffers()  # aliased layers share a buffer: that is no overlap
        if msg.draft is not None:
            d_starts, d_sizes = msg.draft.unique_buffers()
            starts, sizes = [*starts, *d_starts], [*sizes, *d_sizes]
        if msg.staging is not None:
            starts, sizes = [*starts, msg.staging.pool_addr], [*sizes, msg.staging.pool_nbytes]
        order = np.argsort(np.asarray(starts, dtype=np.uint64), kind="stable")
        begin = np.asarray(starts, dtype=np.uint64)[order]
        end = begin + np.asarray(sizes, dtype=np.uint64)[order]
        if begin.size and (begin[0] == 0 or (end < begin).any() or (begin[1:] < end[:-1]).any()):
            return "KV buffers (and staging ring) of the decode overlap, wrap or start at address 0"
        return None

    def _check(self, msg: RegisterPeer) -> str | None:
        why = self.layout.compatible_with(msg.layout)
        if why:
            return f"decode rank {msg.tp_rank} layout incompatible with prefill rank {self.tp_rank}: {why}"
        if not 0 <= msg.tp_rank < msg.tp_size:
            return f"decode tp_rank {msg.tp_rank} outside tp_size {msg.tp_size}"
        why = self._check_state(msg) or self._check_draft(msg) or self._check_addresses(msg)
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

    def _check_draft(self, msg: RegisterPeer) -> str | None:
        """A decode's draft pool must move with ours: compatible, or absent on the decode (which then
        asks for no draft KV). One on the decode only has nothing to fill it."""
        if msg.draft is None:
            return None
        if self.draft_rank is not None:
            return self._check_whole_draft(msg)
        if self.draft_layout is None:
            return f"decode rank {msg.tp_rank} has a draft-model KV pool, this prefill has no draft model"
        why = self.draft_layout.compatible_with(msg.draft)
        if why is None and 0 <= msg.tp_rank < msg.tp_size:  # its shard of heads, split like the target's
            try:
                heads = kv_head_range(msg.tp_size, msg.tp_rank, msg.draft.total_kv_heads)
                self._pair_heads(msg, msg.draft.total_kv_heads)  # the pairing covers its heads once
            except ValueError as e:
                heads, why = None, f"TP {self.tp_size} -> {msg.tp_size}: {e}"
            if heads is not None and (msg.draft.head_start, msg.draft.head_end) != heads:
                why = (
                    f"holds draft KV heads [{msg.draft.head_start}, {msg.draft.head_end}), "
                    f"TP {msg.tp_size} rank {msg.tp_rank} needs [{heads[0]}, {heads[1]})"
                )
        return None if why is None else f"decode rank {msg.tp_rank} draft-model KV pool incompatible: {why}"

    def _check_whole_draft(self, msg: RegisterPeer) -> str | None:
        """With `draft_rank` (NEXTN): a draft pool on that decode rank only, holding every head of
        the draft; this prefill rank's own compatible with it (ranks without one never send)."""
        assert msg.draft is not None
        where = f"decode rank {msg.tp_rank} draft-model KV pool"
        if msg.tp_rank != self.draft_rank:
            return f"{where}: the draft KV (NEXTN's MTP layer, an EAGLE head) lives on TP rank {self.draft_rank} only"
        if (msg.draft.head_start, msg.draft.head_end) != (0, msg.draft.total_kv_heads):
            heads = f"[{msg.draft.head_start}, {msg.draft.head_end})"
            return f"{where} holds heads {heads} of {msg.draft.total_kv_heads}, not all"
        if self.draft_layout is None:  # another prefill rank holds it (and writes it), unless we should
            if self.tp_rank == self.draft_rank:
                return f"{where}: this prefill rank {self.tp_rank} has no draft-model KV pool to send into it"
            return None
        why = self.draft_layout.compatible_with(msg.draft)
        return None if why is None else f"{where} incompatible: {why}"

    def _draft_heads(self, msg: RegisterPeer) -> tuple[int, int] | None:
        """Global draft KV heads this rank writes into decode rank msg.tp_rank (None: none)."""
        assert self.draft_layout is not None
        total = self.draft_layout.total_kv_heads
        if self.draft_rank is None:  # sharded like the target: the target's rank pairing over its heads
            return self._pair_heads(msg, total)
        return (0, total) if self.tp_rank == msg.tp_rank == self.draft_rank else None

    def _pair_heads(self, msg: RegisterPeer, total_kv_heads: int | None = None) -> tuple[int, int] | None:
        """Global KV heads this rank writes into decode rank msg.tp_rank: of the target, or of a
        model with `total_kv_heads` (the draft's) over the same rank pairing."""
        total = self.layout.total_kv_heads if total_kv_heads is None else total_kv_heads
        for s in slices_for_decode_rank(msg.tp_rank, self.tp_size, msg.tp_size, total):
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
        if msg.dst_draft_pages is not None:
            draft = np.asarray(msg.dst_draft_pages, dtype=np.int64)
            if peer.draft is None:
                return peer, "draft pages from a decode rank that registered no draft-model KV pool"
            if draft.size and draft.max() >= peer.draft.num_pages:
                return peer, f"draft page {int(draft.max())} outside the decode's draft pool of {peer.draft.num_pages}"
            if np.unique(draft).size != draft.size:
                return peer, "duplicate draft pages"
        if msg.dst_swa_pages is not None:
            why = window_pages_problem(
                np.asarray(msg.dst_swa_pages, dtype=np.int64),
                peer.layout.num_pages,
                pages,
                exact=True,
                aliased=peer.layout.aliased,
                max_lead=msg.prefix_len // ps,
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

    def prune(
        self, now: float, in_use: set[str], sessions_in_use: frozenset[str] | set[str] = frozenset()
    ) -> list[str]:
        """Forget decodes dead for long with no room using them (`in_use`: control addresses;
        returns theirs), and evict sessions with no room (`sessions_in_use`) for session_idle_s."""
        for s in [s for s, t in self.last_used.items() if now - t > self.idle_s and s not in sessions_in_use]:
            self.evict(s)
        gone = [
            a
            for a in list(self.liveness.dead)
            if a not in in_use and now - self.liveness.last_seen.get(a, now) > self._forget_after_s
        ]
        for a in gone:
            self.liveness.forget(a)
            for s in [s for s, p in self.peers.items() if p.control_address == a]:
                self._forget_session(s)
        return gone


def _host(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
