"""Decode side of KV transfer: one `KVReceiver` per decode instance (it lives with decode rank 0
and speaks for every decode rank). Thread-safe, engine-agnostic.

    ranks = [DecodeRank(KVLayout.from_pool(pool_r, head_start_r, total_kv_heads), backend_r.address)
             for each decode rank r]                  # each rank registered its pool with its backend
    recv = KVReceiver(cfg, ranks=ranks, model_name=name).start()
    recv.add_room(room, bootstrap_host, bootstrap_port, dst_pages, prefix_len)
        # dst_pages: per decode rank, pages for prompt tokens from prefix_len (page aligned) on
    for room, state, reason, aux in recv.poll(): ...  # Success: KV and aux (first token) are in;
                                                      # Failed: free the pages, fail the request
    recv.abort(room, "client disconnected")           # pages stay reserved until poll reports it
    recv.close()

Flow (DESIGN.md §3): add_room asks the prefill's bootstrap server for its ranks (a pool thread,
one fetch per prefill at a time, cached per prefill instance), checks compatibility, sends
RegisterPeer for every (prefill rank, decode rank) pair of the §8 mapping once per prefill
instance, then a TransferRequest per pair. Prefill ranks answer with one final TransferStatus per
pair (receiver_room.py). poll() reports a room only when it is safe to reuse its pages: after
Success, or after a failure once every paired prefill rank gave its final word, the prefill
restarted, or transfer_timeout_s passed since the failure (a silent prefill may be stalled with
writes in flight, so heartbeat death alone does not free pages early). A failure (deadline, abort, a prefill rank's
Failed) sends Abort to the paired prefill ranks. Heartbeats go both ways on the worker thread; a
prefill rank that misses them is dead: its rooms fail, and the next add_room re-fetches the
bootstrap info, so a restarted prefill (new instance id) is picked up and registered again.

Session ids: decode rank r is f"{instance_id}/{r}", prefill rank p is f"{prefill_instance_id}/{p}"
(KVSender); heartbeats carry them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvpipe.transfer.bootstrap import (DEFAULT_BOOTSTRAP_PORT, BootstrapNotReady, BootstrapUnreachable, DecodeInfo,
                                       PrefillInstanceInfo, check_compatible, fetch_prefill_info)
from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.control import ControlEndpoint
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.messages import (Abort, AuxData, Heartbeat, RegisterPeer, Side, TransferRequest,
                                      TransferStatus)
from kvpipe.transfer.receiver_room import ReceiverRoom, rank_pairs
from kvpipe.transfer.state import (Clock, DuplicateRoomError, PeerLiveness, RoomRecord, TransferState,
                                   receiver_timeouts)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeRank:
    layout: KVLayout  # this rank's pool (head range set for its TP rank)
    data_address: str  # its backend's address: where prefill writes


@dataclass
class ReceiverStats:
    rejected_messages: int = 0
    bootstrap_fetches: int = 0
    registrations: int = 0  # RegisterPeer messages sent
    rooms_succeeded: int = 0
    rooms_failed: int = 0


@dataclass
class _Prefill:
    addr: tuple[str, int]
    info: PrefillInstanceInfo
    sessions: dict[str, int]  # prefill session id -> prefill rank


class KVReceiver:
    def __init__(self, cfg: DisaggregationConfig, *, ranks: Sequence[DecodeRank], model_name: str,
                 instance_id: str | None = None, host: str = "127.0.0.1", clock: Clock = time.monotonic) -> None:
        if not ranks:
            raise ValueError("KVReceiver needs at least one decode rank")
        self.cfg, self.ranks, self.model_name = cfg, tuple(ranks), model_name
        self.tp_size = len(self.ranks)
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self.sessions = [f"{self.instance_id}/{r}" for r in range(self.tp_size)]
        self._session_rank = {s: r for r, s in enumerate(self.sessions)}
        self.decode_info = DecodeInfo(model_name, self.tp_size, tuple(d.layout for d in self.ranks))
        self.stats = ReceiverStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timeouts = receiver_timeouts(cfg)
        self._rooms: dict[int, ReceiverRoom] = {}
        self._prefills: dict[tuple[str, int], _Prefill] = {}
        self._by_session: dict[str, tuple[tuple[str, int], int]] = {}  # prefill session -> (addr, rank)
        self._waiting: dict[tuple[str, int], list[int]] = {}  # rooms waiting for a bootstrap fetch
        self._fetch_errors: dict[tuple[str, int], str] = {}  # last error of a fetch still retrying
        self._liveness = PeerLiveness(cfg.heartbeat_timeout_s)
        self._endpoint = ControlEndpoint(host, self._on_message, name="kvreceiver", send_hwm=cfg.control_send_hwm)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvreceiver-bootstrap")
        self._worker = threading.Thread(target=self._run, name="kvreceiver-worker", daemon=True)

    @property
    def control_address(self) -> str:
        return self._endpoint.address

    def start(self) -> "KVReceiver":
        self._endpoint.start()
        self._worker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._worker.is_alive():
            self._worker.join(timeout=5.0)
        self._endpoint.close()

    # ---- engine API ------------------------------------------------------------------------

    def add_room(self, room: int, bootstrap_host: str, bootstrap_port: int | None,
                 dst_pages: Sequence[np.ndarray] | np.ndarray | list[int], prefix_len: int = 0,
                 aux_slot: int = 0) -> None:
        """Ask the prefill at bootstrap_host:bootstrap_port (None: 8998) for request `room`'s KV.

        dst_pages: per decode rank (a single array when tp_size is 1), distinct pages for prompt
        tokens [prefix_len, ...), page i holding tokens prefix_len + i*page_size onwards;
        prefix_len: leading tokens this decode already holds (page aligned). Non-blocking.
        Raises DuplicateRoomError if the room is active already (reject that request only)."""
        pages = self._check_pages(room, dst_pages, prefix_len)
        addr = (bootstrap_host, DEFAULT_BOOTSTRAP_PORT if bootstrap_port is None else int(bootstrap_port))
        with self._lock:
            if room in self._rooms:
                raise DuplicateRoomError(f"bootstrap_room {room} is already active on this decode")
            now = self._clock()
            r = self._rooms[room] = ReceiverRoom(room, RoomRecord.new(room, self._timeouts, now), addr, pages,
                                                 prefix_len, aux_slot)
            peer = self._prefills.get(addr)
            if peer is not None:
                self._request(r, peer, now)
                return
            waiting = self._waiting.setdefault(addr, [])
            waiting.append(room)
            if len(waiting) == 1:  # no fetch for this prefill in flight yet
                self.stats.bootstrap_fetches += 1
                self._pool.submit(self._fetch, addr)

    def _check_pages(self, room: int, dst_pages, prefix_len: int) -> tuple[np.ndarray, ...]:
        if isinstance(dst_pages, np.ndarray) and dst_pages.ndim == 1 or (
                isinstance(dst_pages, list) and all(isinstance(p, (int, np.integer)) for p in dst_pages)):
            dst_pages = [dst_pages]
        pages = tuple(np.asarray(p, dtype=np.int64).ravel() for p in dst_pages)
        if len(pages) != self.tp_size:
            raise ValueError(f"room {room}: {len(pages)} page lists for {self.tp_size} decode ranks")
        ps = self.ranks[0].layout.page_size
        if prefix_len < 0 or prefix_len % ps:
            raise ValueError(f"room {room}: prefix_len {prefix_len} is not a multiple of the page size {ps}")
        for r, p in enumerate(pages):
            n = self.ranks[r].layout.num_pages
            if p.size and (p.min() < 0 or p.max() >= n or np.unique(p).size != p.size):
                raise ValueError(f"room {room}: decode rank {r} pages must be distinct ids in [0, {n})")
        return pages

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        """Fail the room; poll() reports it once no write from the prefill can still land."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                r.rec.fail(reason, self._clock())
                self._settle(r, self._clock())

    def poll(self) -> list[tuple[int, TransferState, str, AuxData | None]]:
        """Rooms that finished and whose pages are safe to reuse (each reported once)."""
        out = []
        with self._lock:
            now = self._clock()
            for room, r in list(self._rooms.items()):
                if not r.rec.state.terminal or not r.quiet(now):
                    continue
                ok = r.rec.state is TransferState.SUCCESS
                out.append((room, r.rec.state, r.rec.reason, r.aux if ok else None))
                del self._rooms[room]
                if ok:
                    self.stats.rooms_succeeded += 1
                else:
                    self.stats.rooms_failed += 1
        return out

    def room_state(self, room: int) -> TransferState | None:
        """Current state of an active room (None once reported by poll, or unknown)."""
        with self._lock:
            r = self._rooms.get(room)
            return None if r is None else r.rec.state

    def num_active_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    # ---- bootstrap, registration, requests ---------------------------------------------------

    def _fetch(self, addr: tuple[str, int]) -> None:
        """Pool thread: fetch a prefill's ranks (retrying while it starts), then request every
        room waiting for it."""
        info, err = None, None
        end = time.monotonic() + self.cfg.bootstrap_timeout_s
        while not self._stop.is_set():
            try:
                info = fetch_prefill_info(*addr, self.cfg.http_timeout_s)
                check_compatible(info, self.decode_info)
                break
            except (BootstrapUnreachable, BootstrapNotReady) as e:
                info, err = None, e
                with self._lock:
                    self._fetch_errors[addr] = str(e)  # named when a waiting room times out
                if time.monotonic() >= end:
                    break
                self._stop.wait(0.05)
            except Exception as e:  # incompatible, malformed, or a bug: fail the rooms with it
                info, err = None, e
                break
        with self._lock:
            now = self._clock()
            rooms = [self._rooms.get(room) for room in self._waiting.pop(addr, [])]
            rooms = [r for r in rooms if r is not None and not r.requested and not r.rec.state.terminal]
            self._fetch_errors.pop(addr, None)
            if info is None:
                why = f"bootstrap with prefill {addr[0]}:{addr[1]} failed: {err}"
                log.warning("%s (%d rooms)", why, len(rooms))
                for r in rooms:
                    r.rec.fail(why, now)
                return
            peer = self._install(addr, info, now)
            for r in rooms:
                self._request(r, peer, now)

    def _install(self, addr: tuple[str, int], info: PrefillInstanceInfo, now: float) -> _Prefill:
        old = self._prefills.get(addr)
        if old is not None and old.info.instance_id == info.instance_id:
            return old
        if old is not None:
            self._drop_prefill(old, f"prefill at {addr[0]}:{addr[1]} restarted (instance "
                                    f"{old.info.instance_id} -> {info.instance_id})", now, gone=True)
        for r in self._rooms.values():  # rooms of an instance dropped earlier: now known to be gone
            if r.prefill == addr and r.instance_id not in (None, info.instance_id):
                r.prefill_gone = True
                r.rec.fail(f"prefill at {addr[0]}:{addr[1]} restarted", now)
        peer = _Prefill(addr, info, {f"{info.instance_id}/{p}": p for p in range(info.tp_size)})
        for p, r in rank_pairs(info.tp_size, self.tp_size):
            d = self.ranks[r]
            self._endpoint.send(info.ranks[p].control_address, RegisterPeer(
                self.sessions[r], r, self.tp_size, d.data_address, self.control_address, d.layout))
            self.stats.registrations += 1
        for s, p in peer.sessions.items():
            self._by_session[s] = (addr, p)
            self._liveness.track(s, now)  # the grace period for its first heartbeat starts now
        self._prefills[addr] = peer
        return peer

    def _request(self, r: ReceiverRoom, peer: _Prefill, now: float) -> None:
        info = peer.info
        ok = True
        for p, rank in rank_pairs(info.tp_size, self.tp_size):
            msg = TransferRequest(r.room, self.sessions[rank], tuple(r.dst_pages[rank].tolist()), r.prefix_len,
                                  r.aux_slot)
            ok &= self._endpoint.send(info.ranks[p].control_address, msg)
        r.requested_from(info.instance_id, info.tp_size, self.tp_size)
        r.rec.move(TransferState.WAITING_FOR_INPUT, now)
        if not ok:
            r.rec.fail(f"control queue to prefill {peer.addr[0]}:{peer.addr[1]} is full", now)
            self._settle(r, now)

    def _drop_prefill(self, peer: _Prefill, why: str, now: float, gone: bool) -> None:
        """Fail the rooms of a prefill instance and forget it (the next add_room fetches again).

        gone=True (it restarted): nothing of the old process can land any more, pages are free at
        once. gone=False (silent): it may only be stalled with writes in flight, so its rooms keep
        their pages until it answers our Abort or transfer_timeout_s passed."""
        log.warning("%s", why)
        for r in self._rooms.values():
            if r.prefill == peer.addr and r.instance_id == peer.info.instance_id:
                r.prefill_gone = r.prefill_gone or gone
                r.rec.fail(why, now)
                self._settle(r, now)
        for s in peer.sessions:
            self._by_session.pop(s, None)
            self._liveness.forget(s)
        if self._prefills.get(peer.addr) is peer:
            del self._prefills[peer.addr]  # the next add_room fetches the bootstrap info again

    def _settle(self, r: ReceiverRoom, now: float) -> None:
        """After a failure: start the quiet deadline and ask the prefill ranks to stop writing."""
        if r.rec.state is not TransferState.FAILED or r.quiet_deadline is not None:
            return
        r.quiet_deadline = now + self.cfg.transfer_timeout_s
        peer = self._prefills.get(r.prefill)
        if (not r.requested or r.all_final or r.prefill_gone or peer is None
                or peer.info.instance_id != r.instance_id):
            return
        for p, rank in rank_pairs(peer.info.tp_size, self.tp_size):
            self._endpoint.send(peer.info.ranks[p].control_address,
                                Abort(r.room, self.sessions[rank], Side.DECODE, r.rec.reason))
        r.aborts_sent = True

    # ---- control messages and the worker -----------------------------------------------------

    def _reject(self, what: str) -> None:
        self.stats.rejected_messages += 1
        log.warning("decode rejected %s", what)

    def _on_message(self, msg: object) -> None:
        with self._lock:
            now = self._clock()
            if isinstance(msg, Heartbeat):
                if msg.session_id in self._by_session:
                    if self._liveness.seen(msg.session_id, now):
                        log.info("prefill session %s is alive again", msg.session_id)
                return
            if not isinstance(msg, (TransferStatus, Abort)):
                return self._reject(f"unexpected {type(msg).__name__} on a decode")
            rank = self._session_rank.get(msg.session_id)
            r = self._rooms.get(msg.room)
            if rank is None or r is None or not r.requested:
                return self._reject(f"{type(msg).__name__} for room {msg.room}, session {msg.session_id}: "
                                    f"{'unknown session' if rank is None else 'room not awaiting a transfer'}")
            if isinstance(msg, Abort):
                if msg.side is not Side.PREFILL:
                    return self._reject(f"Abort for room {msg.room} claiming to come from {msg.side.value}")
                r.rec.fail(f"aborted by prefill: {msg.reason}", now)
            else:
                why = r.on_status(rank, msg, now)
                if why is not None:
                    return self._reject(f"TransferStatus for room {msg.room}: {why}")
            self._settle(r, now)

    def _run(self) -> None:
        seq, next_hb = 0, 0.0
        while not self._stop.is_set():
            try:
                with self._lock:
                    now = self._clock()
                    for r in self._rooms.values():
                        if r.rec.state is TransferState.BOOTSTRAPPING and r.rec.deadline is not None \
                                and now >= r.rec.deadline:
                            err = self._fetch_errors.get(r.prefill)
                            r.rec.fail(f"bootstrap with prefill {r.prefill[0]}:{r.prefill[1]} failed: not done "
                                       f"within {self.cfg.bootstrap_timeout_s}s" + (f" ({err})" if err else ""), now)
                        r.rec.expire(now, "not every prefill rank reported the transfer finished")
                        self._settle(r, now)
                    for s in self._liveness.reap(now):
                        addr, p = self._by_session.get(s, (None, 0))
                        peer = self._prefills.get(addr) if addr is not None else None
                        if peer is not None and s in peer.sessions:
                            self._drop_prefill(peer, f"prefill rank {p} at {addr[0]}:{addr[1]} sent no "
                                               f"heartbeat for {self.cfg.heartbeat_timeout_s:.1f}s", now, gone=False)
                    if now >= next_hb:
                        next_hb = now + self.cfg.heartbeat_interval_s
                        for peer in self._prefills.values():
                            for p, rank in dict(rank_pairs(peer.info.tp_size, self.tp_size)).items():
                                self._endpoint.send(peer.info.ranks[p].control_address,
                                                    Heartbeat(self.sessions[rank], seq))
                        seq += 1
            except Exception:
                log.exception("decode transfer worker error")
            self._stop.wait(self.cfg.idle_tick_s)
