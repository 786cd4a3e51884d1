"""What the prefill and decode connectors share: rank 0's TransferWorker, room claims, start-up
of every rank's worker."""

from __future__ import annotations

import threading
from typing import Any

from kvpipe.config import ServerConfig
from kvpipe.disagg.commands import RankStarted
from kvpipe.disagg.transfer_worker import WORKER_FACTORY, TransferWorker
from kvpipe.engine.connector import ConnectorContext, KVConnector, WorkerGroup
from kvpipe.transfer.backends.base import TransferBackend
from kvpipe.transfer.backends.registry import check_backend

START_MARGIN_S = 30.0  # on top of the bootstrap timeout: backend start-up of every rank on a loaded host


class PDConnector(KVConnector):
    worker_factory = WORKER_FACTORY
    side = "pd"

    def __init__(self, cfg: ServerConfig, backend: TransferBackend | None = None) -> None:
        """`backend`: rank 0's transfer backend (tests pass an in-process one); made otherwise."""
        check_backend(cfg.disaggregation, cfg.tp_size)
        self.cfg = cfg
        self._backend = backend
        self.local_worker: TransferWorker | None = None  # rank 0's (the engine owns and closes it)
        self.ranks: list[RankStarted] = []  # every rank's worker, once started
        self._claim_lock = threading.Lock()
        self._claimed: set[int] = set()  # rooms of requests claimed and not yet done with (any thread)

    def make_worker(self, pool: Any, total_kv_heads: int, state_pool: Any = None) -> TransferWorker:
        self.local_worker = TransferWorker(self.cfg, 0, pool, total_kv_heads, self._backend, state_pool)
        return self.local_worker

    def _attach_draft(self, ctx: ConnectorContext) -> None:
        """Rank 0's worker registers and moves the draft model's KV too (before the start)."""
        if self.local_worker is not None:
            self.local_worker.set_draft_pool(ctx.draft_pool, ctx.draft_kv_heads)

    def _start_ranks(self, workers: WorkerGroup, cmd: object) -> None:
        timeout = self.cfg.disaggregation.bootstrap_timeout_s + START_MARGIN_S
        self.ranks = [r for r in workers.call(cmd, timeout) if isinstance(r, RankStarted)]

    def _claim_room(self, room: int) -> None:
        with self._claim_lock:
            if room in self._claimed:
                raise ValueError(f"bootstrap_room {room} is already in use on this {self.side} server")
            self._claimed.add(room)

    def _release_room(self, room: int | None) -> None:
        with self._claim_lock:
            self._claimed.discard(room)
