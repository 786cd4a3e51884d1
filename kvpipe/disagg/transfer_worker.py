"""`TransferWorker`: the KV connector worker of one TP rank of a PD server (rank 0 included).

Every TP rank holds a shard of the KV pool (its KV heads), so every rank moves its own KV:
- prefill: the rank runs its own `KVSender` (tp_rank r of N, the instance id rank 0 chose),
  registered with rank 0's bootstrap server. Inside its forward it starts the step's rooms
  (`before_forward`) and, with layer pipelining, sends each finished layer group from its own
  layer-group hook (`after_layers`; on CUDA gated on an event recorded after the group). Between
  forwards it sends finished chunks, fails and aborts rooms as rank 0 commands. `poll` reports
  the rooms its sender is done with.
- decode: the rank registers its pool with its own backend and tells rank 0 its layout and data
  address; rank 0's KVReceiver speaks for it.
With a STANDALONE draft model every rank also registers its shard of the draft model's KV pool,
which moves as the layers after the target's (disagg/draft_transfer.py); with NEXTN rank 0 alone
registers the MTP layer's KV pool, which prefill rank 0 writes into decode rank 0
(disagg/mtp_transfer.py).
Errors of one room (a refused page table, a planning error) fail that room on this rank; rank 0
tallies every rank's outcome (kvpipe/disagg/tally.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import ServerConfig
from kvpipe.disagg.commands import (
    AbortRooms,
    ChunkSend,
    FailRooms,
    PrefillStep,
    RankReport,
    RankStarted,
    SendChunks,
    StartDecode,
    StartPrefill,
)
from kvpipe.disagg.draft_transfer import draft_layout, speculative_handshake
from kvpipe.disagg.mtp_transfer import MTP_RANK
from kvpipe.disagg.setup import data_host, make_backend, rank_layout, rank_state_layout, register_pool
from kvpipe.engine.connector import KVConnectorWorker
from kvpipe.engine.spec.registry import DraftKV, draft_kv
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.control.auth import authenticator
from kvpipe.transfer.control.handshake import Handshake
from kvpipe.transfer.kv_digest import KVDigester
from kvpipe.transfer.lifecycle import DuplicateRoomError, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.sender.kv_sender import KVSender
from kvpipe.transfer.sender.stats import SenderStats
from kvpipe.transfer.staging.buffers import KVBytes, StagingAgent, StagingBuffer

logger = logging.getLogger(__name__)

POLL_S = 0.002  # a prefill TP child polls its sender this often while no command arrives
STATS_EVERY_S = 0.5  # ... and pushes changed counters at most this often without a finished room


class TransferWorker(KVConnectorWorker):
    def __init__(
        self,
        cfg: ServerConfig,
        rank: int,
        pool: KVPool,
        total_kv_heads: int,
        backend: TransferBackend | None = None,
        state_pool: StatePool | None = None,
    ) -> None:
        """`state_pool`: a hybrid model's recurrent state, which moves with the KV."""
        self.cfg, self.rank = cfg, rank
        self.layout = rank_layout(cfg, rank, pool, total_kv_heads)
        self.state_layout = None if state_pool is None else rank_state_layout(cfg, rank, state_pool)
        self.backend = backend  # None: made at start (tests pass an in-process one)
        self._own_backend = backend is None
        self.sender: KVSender | None = None
        self.staging_agent: StagingAgent | None = None  # decode with --disaggregation-staging-buffer
        self._pool = pool
        self.poll_interval_s = POLL_S if cfg.disaggregation.mode == "prefill" else None
        self._cuda = pool.k[0].device.type == "cuda"
        self._failed: list[tuple[int, TransferState, str]] = []  # rooms refused here, reported next poll
        self._sent_stats: SenderStats | None = None
        self._next_stats = 0.0
        self._closed = False
        # set by rank 0's connector before the start: the sender wakes the engine loop with it when
        # a room is ready to report (a TP child's reports reach rank 0 on its poll timer)
        self.on_news: Callable[[], None] | None = None
        # set by rank 0's connector before the start (set_draft_pool): the draft model's KV pool
        self.draft_layout: KVLayout | None = None
        # NEXTN's MTP layer (or an EAGLE head) and its KV live on another TP rank (MTP_RANK): none moves from here
        self._draft_at_rank0 = draft_kv(cfg.speculative) is DraftKV.RANK0
        self._mtp_elsewhere = self._draft_at_rank0 and rank != MTP_RANK

    def set_draft_pool(self, pool: KVPool | None, total_kv_heads: int | None = None) -> None:
        """The engine's STANDALONE draft model keeps this rank's shard of its KV in `pool`
        (`total_kv_heads`: the draft model's before TP; None: the pool's own, TP 1): it is
        registered and sent with the target's KV (before the start)."""
        self.draft_layout = None if pool is None else draft_layout(self.cfg, self.rank, pool, total_kv_heads)

    def kv_digester(self) -> KVDigester:
        """Digests of this rank's KV pool (transfer/kv_digest.py: end-to-end KV integrity)."""
        return KVDigester(self._pool.buffers(), self.layout)

    # ---- between forwards ------------------------------------------------------------------
    def handle(self, cmd: object) -> object | None:
        if isinstance(cmd, (StartPrefill, StartDecode)):
            return self._start(cmd)
        if isinstance(cmd, SendChunks):
            for s in cmd.sends:
                self._send(s)
            # submit them here, between forwards, instead of after the sender thread's wake-up
            self._prefill_sender().pump()
        elif isinstance(cmd, FailRooms):
            for room, reason in cmd.rooms:
                self._fail(room, reason)
        elif isinstance(cmd, AbortRooms):
            for room, reason in cmd.rooms:
                self._prefill_sender().abort(room, reason)
        else:
            raise TypeError(f"TP rank {self.rank}'s transfer worker got an unexpected {type(cmd).__name__}")
        return None

    def _start(self, cmd: StartPrefill | StartDecode) -> RankStarted:
        if self.backend is None:
            self.backend = make_backend(self.cfg)
        register_pool(self.backend, self.layout, self.state_layout, self.draft_layout)
        d = self.cfg.disaggregation
        control = None
        staging = d.staging != "off"
        if staging and self.layout.latent:
            logger.info(
                "TP rank %d: --disaggregation-staging-buffer %s ignored: the MLA latent is replicated on "
                "every rank and never head-sliced, so whole-page writes already coalesce",
                self.rank,
                d.staging,
            )
            staging = False
        if staging and self.layout.swa_layers:
            logger.info(
                "TP rank %d: --disaggregation-staging-buffer %s ignored: sliding-window layers move only "
                "the window's pages (their own page table), which a staged chunk cannot carry",
                self.rank,
                d.staging,
            )
            staging = False
        if isinstance(cmd, StartPrefill):
            buf = StagingBuffer(KVBytes.from_pool(self._pool), self.backend, d.staging_pool_nbytes) if staging else None
            self.sender = KVSender(
                d,
                layout=self.layout,
                backend=self.backend,
                tp_rank=self.rank,
                tp_size=self.cfg.tp_size,
                model_name=self.cfg.model_name,
                instance_id=cmd.instance_id,
                host=data_host(self.cfg),
                staging=buf,
                state_layout=self.state_layout,
                on_news=self.on_news,
                handshake=cmd.handshake,
                draft_layout=self.draft_layout,
                # NEXTN: the MTP KV sits on the target's page ids, a decode's prefix holds it too
                draft_at_prefix=self._draft_at_rank0,
                # NEXTN (or an EAGLE head): the MTP layer and its KV live whole on TP rank 0 of each side
                draft_rank=MTP_RANK if self._draft_at_rank0 else None,
                digester=self.kv_digester(),  # for decodes that check the KV they got
            )
            self.sender.start(bootstrap=cmd.bootstrap, registrar_key=cmd.registrar_key or None)
            control = self.sender.control_address
        elif staging:  # decode: a staging ring on this rank, scattered by this process
            self.staging_agent = StagingAgent(
                self.layout,
                KVBytes.from_pool(self._pool),
                self.backend,
                d.staging_pool_nbytes,
                host=data_host(self.cfg),
                session_id=f"{self.backend.address}/{self.rank}",
                lease_s=2 * d.transfer_timeout_s,
                send_hwm=d.tuning.control_send_hwm,
                auth=authenticator(d.auth_token),
                limits=d.limits,
                ports=d.control_ports,
            ).start()
        return RankStarted(
            self.rank,
            self.layout,
            self.backend.address,
            control,
            None if self.staging_agent is None else self.staging_agent.info,
            self.state_layout,
            draft=self.draft_layout,
        )

    def handshake(self, model_digest: str) -> Handshake:
        """What this server's peers must agree with (control/handshake.py): the checkpoint's
        digest, this rank's pool without its TP-dependent parts, its fp8 scales, its state pool,
        and the speculative settings that change what moves (draft_transfer.py)."""
        pool = self._pool
        spec = speculative_handshake(self.cfg, self.draft_layout)
        return Handshake.of(
            model_digest,
            self.layout,
            pool.k_scale,
            pool.v_scale,
            self.state_layout,
            spec,
            quantization=self.cfg.quantization,
        )

    def _prefill_sender(self) -> KVSender:
        if self.sender is None:
            raise TypeError(f"TP rank {self.rank} has no KV sender (not a started prefill)")
        return self.sender

    def _fail(self, room: int, reason: str) -> None:
        """Fail a room the prefill gave up on. A room the engine never gave pages (unknown here,
        or known only from the decode's TransferRequest) is added without pages first: the
        sender reports only rooms the engine added, and the decode hears Failed."""
        s = self._prefill_sender()
        try:
            s.add_room(room, np.zeros(0, dtype=np.int64))
        except DuplicateRoomError:
            pass  # its forward started it already
        except ValueError as e:
            self._failed.append((room, TransferState.FAILED, f"cannot report the failure: {e}"))
            return
        s.abort(room, reason)

    def _send(
        self, c: ChunkSend, layer_start: int = 0, layer_end: int | None = None, ready: Callable[[], bool] | None = None
    ) -> None:
        s = self._prefill_sender()
        try:
            s.send(
                c.room,
                c.token_start,
                c.token_end,
                layer_start,
                layer_end,
                last=c.last,
                aux=c.aux,
                ready=ready,
                state=c.state,
                src_swa_pages=c.swa_pages,
            )
        except KeyError:
            pass  # the room never entered this sender: its refusal is reported already
        except ValueError as e:  # a planning error fails this room, not the batch
            logger.warning("room %d on TP rank %d: %s", c.room, self.rank, e)
            s.abort(c.room, f"send on TP rank {self.rank} failed: {e}")

    # ---- inside the rank's forward -----------------------------------------------------------
    def before_forward(self, meta: Any) -> None:
        if not isinstance(meta, PrefillStep):
            return
        s = self._prefill_sender()
        for start in meta.start:
            # NEXTN: a room's MTP pages are rank 0's (disagg/mtp_transfer.py); other ranks hold no MTP pool
            draft = None if self._mtp_elsewhere else start.draft_pages
            try:
                s.add_room(start.room, start.pages, start.state_slot, start.swa_pages, draft, claim=start.claim)
            except ValueError as e:  # nothing of this room is in our sender: report it failed
                self._failed.append((start.room, TransferState.FAILED, f"add_room refused on TP rank {self.rank}: {e}"))

    def after_layers(self, meta: Any, start: int, end: int) -> None:
        """Layers [start, end) hold their KV: ship them while the next group computes (full
        pages only; the final send flushes each layer's partial page)."""
        if not isinstance(meta, PrefillStep) or not meta.grouped:
            return
        ready = self._group_ready()
        for c in meta.grouped:
            self._send(c, start, end, ready)

    def _group_ready(self) -> Callable[[], bool] | None:
        """What a write of the group's KV waits for: None on CPU (the forward is synchronous),
        else the query of a CUDA event recorded after the group's kernels."""
        if not self._cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev.query

    # ---- news for rank 0 ---------------------------------------------------------------------
    def poll(self) -> RankReport | None:
        if self.sender is None:
            return None
        done = self._failed + self.sender.poll()
        self._failed = []
        taken = tuple(self.sender.take_timings())  # drained on every rank; rank 0's model the link
        timings = taken if self.rank == 0 else ()
        now = time.monotonic()
        stats = replace(self.sender.stats)
        if not (done or timings or (now >= self._next_stats and stats != self._sent_stats)):
            return None
        self._sent_stats, self._next_stats = stats, now + STATS_EVERY_S
        return RankReport(self.rank, tuple(done), stats, timings)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.sender is not None:
            self.sender.close()
        if self.staging_agent is not None:
            self.staging_agent.close()
        if self._own_backend and self.backend is not None:
            self.backend.close()


def make_worker(
    cfg: ServerConfig, rank: int, pool: KVPool, total_kv_heads: int, state_pool: StatePool | None = None
) -> TransferWorker:
    """The WorkerFactory TP children import (kvpipe.engine.connector)."""
    return TransferWorker(cfg, rank, pool, total_kv_heads, state_pool=state_pool)


WORKER_FACTORY = f"{__name__}:make_worker"
