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

What happens inside: every decision is the `ReceiverBook`'s (book.py: rooms, known
prefills, deadlines, liveness, when pages are safe; no I/O). This shell owns the I/O: a receive
thread (control/endpoint.py) hands TransferStatus, Abort and Heartbeat to the book; a pool thread fetches
a prefill's bootstrap info when the book asks (only where `guard` allows, control/fetch_guard.py;
retrying while a prefill that answered before restarts, then checking compatibility: a refused
handshake fails every waiting room and posts them to the prefill's bootstrap server, which fails
them there too, control/handshake.py) and hands the outcome back; a worker thread drives the
book's deadlines and liveness every receiver_tick_s (TransferTuning; a gap in its own ticks is not
the prefills' silence: lifecycle.PeerLiveness.observed); heartbeats leave from their own thread
(control/pulse.py). Control messages leave through the endpoint, never blocking.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.control.auth import authenticator
from kvpipe.transfer.control.bootstrap import (
    BootstrapError,
    BootstrapNotReady,
    BootstrapRefused,
    BootstrapUnreachable,
    DecodeInfo,
    IncompatiblePeerError,
    PrefillInstanceInfo,
    check_compatible,
    fetch_prefill_info,
    report_refusal,
)
from kvpipe.transfer.control.bootstrap_address import parse_bootstrap_address
from kvpipe.transfer.control.endpoint import ControlEndpoint
from kvpipe.transfer.control.fetch_guard import FetchGuard
from kvpipe.transfer.control.handshake import MAX_REFUSED_ROOMS, Handshake, RefusalNotice
from kvpipe.transfer.control.messages import RECEIVER_RECEIVES, AuxData, DecodeRank, limits_for
from kvpipe.transfer.control.pulse import Pulse
from kvpipe.transfer.kv_digest import KEY_BYTES, KVDigester
from kvpipe.transfer.lifecycle import Clock, TransferState
from kvpipe.transfer.planning.tp_mapping import slices_for_decode_rank
from kvpipe.transfer.receiver.book import Address, ReceiverBook
from kvpipe.transfer.receiver.room import ReceiverRoom
from kvpipe.transfer.receiver.stats import ReceiverStats

log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(
        self,
        cfg: DisaggregationConfig,
        *,
        ranks: Sequence[DecodeRank],
        model_name: str,
        instance_id: str | None = None,
        host: str = "127.0.0.1",
        clock: Clock = time.monotonic,
        on_news: Callable[[], None] | None = None,
        handshake: Handshake | None = None,
        max_aux_bytes: int = 0,
        digester: KVDigester | None = None,
    ) -> None:
        """`on_news` (called on the control thread after every message from a prefill, and on the
        worker thread at its tick when a room became reportable otherwise): poll() has something
        new; the engine loop sleeps until it is called (DECODE_TRANSFER_BACKSTOP_S at most).
        `max_aux_bytes`: the largest raw field a prefill's aux data may carry (NEXTN's hidden state,
        AuxData.hidden; 0: none), a bound of the control frames this receiver decodes.
        `handshake`: this decode instance's (control/handshake.py), compared with every prefill's
        (None: not checked; tests and benchmarks of bare receivers). `digester`: over decode rank
        0's pool, with cfg.kv_integrity (kv_digest.py: every room's KV checked before it is reported
        a Success; decode TP 1 only, for now)."""
        if not ranks:
            raise ValueError("KVReceiver needs at least one decode rank")
        if cfg.kv_integrity and (digester is None or len(ranks) != 1):
            raise ValueError(
                "--disaggregation-kv-integrity needs decode rank 0's pool and a decode TP size of 1 "
                f"(this decode has {len(ranks)} ranks): the other ranks' KV is not checked yet"
            )
        self._digester = digester
        self.cfg, self.ranks, self.model_name = cfg, tuple(ranks), model_name
        self.tp_size = len(self.ranks)
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self.handshake = handshake
        self.decode_info = DecodeInfo(model_name, self.tp_size, tuple(d.layout for d in self.ranks), handshake)
        self._clock = clock
        self._on_news = on_news
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._auth = authenticator(cfg.auth_token)  # control frames and bootstrap look-ups
        self._endpoint = ControlEndpoint(
            host,
            self._on_message,
            name="kvreceiver",
            send_hwm=cfg.tuning.control_send_hwm,
            auth=self._auth,
            # statuses, aborts, heartbeats: no int lists; raw bytes (AuxData.hidden) up to max_aux_bytes
            limits=limits_for(RECEIVER_RECEIVES, -(-max_aux_bytes // 8)),
            max_sockets=cfg.limits.max_reply_sockets,
            ports=cfg.control_ports,
        )
        self._book = ReceiverBook(
            cfg,
            self.ranks,
            self.instance_id,
            self._endpoint.address,
            self._endpoint.send,
            verify=self._verify if cfg.kv_integrity else None,
            reconnect=self._endpoint.disconnect,
        )
        self.sessions = self._book.sessions  # per decode rank: its session id on the wire
        self.guard = FetchGuard(
            cfg.bootstrap_allow,
            cfg.tuning.bootstrap_negative_ttl_s,
            loopback_only=cfg.auth_token is None and not cfg.insecure,
        )
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvreceiver-bootstrap")
        # fetches of prefills fetched from before (restarts) never queue behind bogus hosts'
        self._proven_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvreceiver-bootstrap-proven")
        # looks for prefills dropped for silence (receiver/lost.py), one attempt each: never in a request's way
        self._lost_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreceiver-bootstrap-lost")
        self._worker = threading.Thread(target=self._run, name="kvreceiver-worker", daemon=True)
        self._pulse = Pulse(cfg.heartbeat_interval_s, self._beat, "kvreceiver", clock)

    @property
    def stats(self) -> ReceiverStats:
        with self._lock:
            st = self._book.stats
            return replace(
                st, auth_rejected=self._endpoint.stats.auth_rejected, handshakes_refused=dict(st.handshakes_refused)
            )

    @property
    def control_address(self) -> str:
        return self._endpoint.address

    def unreachable(self) -> str | None:
        """Why this decode has no prefill it can serve with (readiness), or None (book.unreachable)."""
        with self._lock:
            return self._book.unreachable(self._clock())

    def num_rooms(self) -> int:
        """Rooms the book still holds (finished ones leave it): 0 once idle, else a leak."""
        with self._lock:
            return len(self._book.rooms)

    def start(self) -> KVReceiver:
        self._endpoint.start()
        self._worker.start()
        self._pulse.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._proven_pool.shutdown(wait=False, cancel_futures=True)
        self._lost_pool.shutdown(wait=False, cancel_futures=True)
        self._pulse.close()
        if self._worker.is_alive():
            self._worker.join(timeout=5.0)
        self._endpoint.close()

    # ---- engine API ------------------------------------------------------------------------

    def add_room(
        self,
        room: int,
        bootstrap_host: str,
        bootstrap_port: int | None,
        dst_pages: Sequence[np.ndarray] | np.ndarray | list[int],
        prefix_len: int = 0,
        aux_slot: int = 0,
        state_slot: int | None = None,
        swa_pages: Sequence[np.ndarray] | np.ndarray | list[int] | None = None,
        draft_pages: np.ndarray | list[int] | None = None,
        claim: bytes = b"",
    ) -> None:
        """Ask the prefill at bootstrap_host:bootstrap_port (None: 8998) for request `room`'s KV.

        dst_pages: per decode rank (a single array when tp_size is 1), distinct pages for prompt
        tokens [prefix_len, ...), page i holding tokens prefix_len + i*page_size onwards;
        prefix_len: leading tokens this decode already holds (page aligned); state_slot: the
        request's recurrent-state slot (hybrid models; the same slot id on every decode rank),
        which the prefill fills before it reports Success; swa_pages: sliding-window models (and
        only they): per decode rank like dst_pages and aligned with them at its end, the page of the
        sliding layers for the same logical page, -1 where none is wanted (outside the window, or
        held already), up to prefix_len // page_size entries more before them for logical pages
        below the prefix (the prompt's last window reaching back into it); the prefill writes the
        sliding layers into those pages only; draft_pages: a decode whose ranks
        have draft-model pools (STANDALONE speculative decoding, each rank its shard of the draft's
        heads): their pages for the prompt's draft KV from token 0, the same ids on every rank,
        which the prefill fills if it has the draft KV (the aux data's draft_tokens says how much);
        claim: messages.room_claim(room, prompt), what shows the prefill this decode was sent the
        request (b"": none; a prefill that knows the room's claim then refuses it). Non-blocking.
        Raises DuplicateRoomError if the room is active already, BootstrapRefused if this decode
        may not fetch from that address (reject that request only)."""
        pages = self._book.check_pages(room, dst_pages, prefix_len)
        self._book.check_state_slot(room, state_slot)
        swa = self._book.check_swa_pages(room, swa_pages, pages, prefix_len)
        draft = self._book.check_draft_pages(room, draft_pages)
        addr = parse_bootstrap_address(bootstrap_host, bootstrap_port)  # BootstrapRefused: malformed
        why = self.guard.refusal(addr)
        if why is not None:
            raise BootstrapRefused(why)
        with self._lock:
            key = secrets.token_bytes(KEY_BYTES) if self.cfg.kv_integrity else b""
            fetch = self._book.add_room(
                room, addr, pages, prefix_len, aux_slot, self._clock(), state_slot, swa, draft, claim, key
            )
            if fetch is not None:
                (self._proven_pool if self.guard.proven(fetch) else self._pool).submit(self._fetch, fetch)

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        """Fail the room; poll() reports it once no write from the prefill can still land."""
        with self._lock:
            self._book.abort(room, reason, self._clock())

    def abort_unrequested(
        self,
        room: int,
        bootstrap_host: str,
        bootstrap_port: int | None,
        reason: str = "aborted by decode",
        claim: bytes = b"",
    ) -> bool:
        """A request this decode never opened a room for (it waited for pages) is gone: tell the
        prefill, if this decode knows it, so the prefill frees the request's KV now instead of
        holding it until its bootstrap timeout. True when the prefill ranks were told."""
        with self._lock:
            return self._book.abort_unrequested(
                room, parse_bootstrap_address(bootstrap_host, bootstrap_port), reason, claim
            )

    def poll(self) -> list[tuple[int, TransferState, str, AuxData | None]]:
        """Rooms that finished and whose pages are safe to reuse (each reported once)."""
        with self._lock:
            return self._book.poll(self._clock())

    def room_state(self, room: int) -> TransferState | None:
        """Current state of an active room (None once reported by poll, or unknown)."""
        with self._lock:
            return self._book.room_state(room)

    def num_active_rooms(self) -> int:
        with self._lock:
            return self._book.num_active_rooms()

    def _verify(self, r: ReceiverRoom) -> str | None:
        """Why room `r`'s pages hold other KV than its prefill ranks wrote, or None (kv_digest.py);
        under the lock, on the engine thread's poll, before the request's first decode step."""
        assert self._digester is not None and r.integrity_key
        total = self.ranks[0].layout.total_kv_heads
        for s in slices_for_decode_rank(0, r.prefill_tp, self.tp_size, total):
            got = r.digests.get((0, s.prefill_rank), b"")
            if not got:
                return f"KV integrity: prefill rank {s.prefill_rank} sent no digest of the KV it wrote"
            if got != self._digester.digest(r.integrity_key, r.dst_pages[0], (s.head_start, s.head_end)):
                return (
                    f"KV integrity check failed: the KV in this request's pages differs from what prefill "
                    f"rank {s.prefill_rank} wrote (heads {s.head_start}-{s.head_end - 1}); something else "
                    "wrote into the decode's KV pool after the transfer"
                )
        return None

    # ---- threads ---------------------------------------------------------------------------

    def _fetch(self, addr: Address, once: bool = False) -> None:
        """Pool thread: fetch a prefill's ranks (retrying while it starts; `once`: one attempt, a look
        for a prefill dropped for silence), check them, tell the book."""
        info: PrefillInstanceInfo | None = None
        err: Exception | None = None
        end = time.monotonic() + self.cfg.bootstrap_timeout_s
        proven = self.guard.proven(addr)
        connect_to: str | None = None
        while not self._stop.is_set():
            try:
                connect_to = self.guard.connect_to(addr.host)  # BootstrapRefused: not allowed
                info = fetch_prefill_info(*addr, self.cfg.tuning.http_timeout_s, self._auth, connect_to)
                check_compatible(info, self.decode_info)
                self.guard.succeeded(addr)
                break
            except IncompatiblePeerError as e:  # a real prefill that answered: not a failed address
                info, err = None, e
                break
            except (BootstrapUnreachable, BootstrapNotReady) as e:
                info, err = None, e
                with self._lock:
                    self._book.fetch_retrying(addr, str(e))
                # an address that never answered is not waited for: a bogus host would hold this
                # worker for the whole bootstrap timeout (a server that says "not ready" is)
                if once or time.monotonic() >= end or (not proven and isinstance(e, BootstrapUnreachable)):
                    break
                self._stop.wait(0.05)
            except Exception as e:  # incompatible, malformed, or a bug: fail the rooms with it
                info, err = None, e
                break
        refused = err if isinstance(err, IncompatiblePeerError) else None
        if isinstance(err, BootstrapError) and err.detail:  # the peer's words: our log, never the client's error
            # a look for a lost prefill fails every heartbeat interval while it is away: not a warning each time
            log.log(
                logging.DEBUG if once else logging.WARNING,
                "bootstrap server %s: %s (it said: %s)",
                addr,
                err,
                err.detail,
            )
        if err is not None and info is None and refused is None:
            self.guard.failed(addr, str(err))  # unproven: refused for a while (a proven one is not)
        with self._lock:
            failed = self._book.on_fetched(addr, info, None if err is None else str(err), self._clock())
            claims = {room: self._book.rooms[room].claim for room in failed if room in self._book.rooms}
            if refused is not None and failed:
                self._book.stats.count_refused(refused.reason, len(failed))
        if refused is not None and failed:
            if self._on_news is not None:
                self._on_news()  # the engine answers the refused requests now
            self._report_refusal(addr, connect_to, [(room, claims.get(room, b"")) for room in failed], refused)

    def _report_refusal(
        self, addr: Address, connect_to: str | None, rooms: list[tuple[int, bytes]], err: IncompatiblePeerError
    ) -> None:
        """Tell the prefill which rooms this decode refused (and why), so it fails them now rather
        than at its bootstrap timeout. Each handshake with an incompatible prefill is tried anew
        (the address is not refused for a while like one that failed): a prefill restarted with a
        matching configuration is accepted at once, and every refused request is reported."""
        for i in range(0, len(rooms), MAX_REFUSED_ROOMS):
            part = rooms[i : i + MAX_REFUSED_ROOMS]
            claims = tuple(c for _, c in part) if all(c for _, c in part) else ()  # every room's, or none
            notice = RefusalNotice(tuple(r for r, _ in part), str(err), err.reason, self.handshake, claims)
            try:
                report_refusal(*addr, notice, self.cfg.tuning.http_timeout_s, self._auth, connect_to)
            except Exception as e:  # best effort: the prefill's bootstrap timeout frees them anyway
                log.warning("could not report refused rooms to prefill %s: %s", addr, e)
                return

    def _on_message(self, msg: object) -> None:
        with self._lock:
            self._book.on_message(msg, self._clock())
        if self._on_news is not None:
            self._on_news()

    def _beat(self, now: float) -> None:
        with self._lock:
            self._book.heartbeats(now)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    now = self._clock()
                    self._book.liveness.observed(now, self.cfg.heartbeat_interval_s)
                    self._book.housekeeping(now)
                    news = self._book.has_news(now)
                    lost = self._book.take_refetches(now)
                for addr in lost:
                    with contextlib.suppress(RuntimeError):  # closing: the pool takes no more
                        self._lost_pool.submit(self._fetch, addr, True)
                # a room reportable for a reason no message brought (a deadline, a write that can
                # no longer land, a failed bootstrap fetch): the engine hears it within a tick
                if news and self._on_news is not None:
                    self._on_news()
            except Exception:
                log.exception("decode transfer worker error")
            self._stop.wait(self.cfg.tuning.receiver_tick_s)
