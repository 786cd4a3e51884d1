"""A small in-test KV connector (kvpipe/engine/connector.py) that exercises the engine's seam
without a transfer layer: it plans fixed layer groups, records what the engine tells it, holds a
finished request's pages until the test ends its "transfer", and lets a test hand KV to a REMOTE
request by copying pages from another engine's pool."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.connector import (
    Admission,
    ConnectorContext,
    ConnectorEvent,
    ForwardPlan,
    KVArrived,
    KVConnector,
    KVConnectorWorker,
    TransferFinished,
)
from kvpipe.engine.request import FinishReason, Req


class RecordingWorker(KVConnectorWorker):
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.groups: list[tuple[Any, int, int]] = []  # (meta, start, end) of every after_layers
        self.commands: list[object] = []

    def handle(self, cmd: object) -> object | None:
        self.commands.append(cmd)
        return ("ack", cmd)

    def after_layers(self, meta: Any, start: int, end: int) -> None:
        self.groups.append((meta, start, end))


class RecordingConnector(KVConnector):
    worker_factory = "unused:in-process"  # TP 1 only

    def __init__(self, groups: Any = 1, remote: bool = False, hold: bool = False) -> None:
        """groups: a count, or a function of the batch; remote: requests get their KV from the
        test (`deliver`); hold: a finished request's pages wait for `end_transfer`."""
        self.groups, self.remote, self.hold = groups, remote, hold
        self.chunks: list[tuple[str, int, int]] = []  # (rid, start, end) of every committed prefill row
        self.firsts: list[int] = []  # first tokens, as after_commit saw them
        self.finished: list[tuple[str, FinishReason]] = []
        self.reserved: list[Req] = []
        self.owned: set[str] = set()  # rids whose pages a "transfer" holds
        self._events: list[ConnectorEvent] = []
        self.worker: RecordingWorker | None = None
        self.ctx: ConnectorContext | None = None

    def make_worker(self, pool: Any, total_kv_heads: int, state_pool: Any = None) -> RecordingWorker:
        self.state_pool = state_pool  # a hybrid model's: its state moves with the KV
        self.worker = RecordingWorker(pool)
        return self.worker

    def start(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx

    def claim(self, req: Req) -> None:
        if req.rid.startswith("refuse"):
            raise ValueError("refused by the connector")

    def admit(self, req: Req) -> Admission:
        return Admission.REMOTE if self.remote else Admission.LOCAL

    def on_reserved(self, req: Req) -> None:
        self.reserved.append(req)

    def plan_forward(self, batch: ScheduledBatch) -> ForwardPlan:
        n = self.groups(batch) if callable(self.groups) else self.groups
        return ForwardPlan(n, meta=("batch", batch.num_tokens))

    def after_commit(self, batch: ScheduledBatch) -> None:
        for i, req in enumerate(batch.reqs):
            self.chunks.append((req.rid, batch.prefix_lens[i], batch.prefix_lens[i] + batch.extend_lens[i]))
            if batch.completes_prefill(i) and req.output_ids:
                self.firsts.append(req.output_ids[0])

    def on_finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        self.finished.append((req.rid, reason))
        if self.hold:
            self.owned.add(req.rid)
        return self.hold

    def end_transfer(self, rid: str, ok: bool = True, reason: str = "") -> None:
        self._events.append(TransferFinished(rid, ok, reason))
        self.owned.discard(rid)

    def deliver(self, req: Req, src_pool: Any, src_pages: np.ndarray, first_token: int) -> None:
        """'Transfer' a prompt's KV from another engine's pool into req's reserved pages."""
        assert self.worker is not None
        for layer in range(len(src_pool.k)):
            self.worker.pool.k[layer][req.pages] = src_pool.k[layer][src_pages]
            self.worker.pool.v[layer][req.pages] = src_pool.v[layer][src_pages]
        self._events.append(KVArrived(req.rid, first_token, 0.0))

    def poll(self) -> list[ConnectorEvent]:
        out, self._events = self._events, []
        return out

    def wait_hint(self) -> float | None:
        return 0.01 if self.owned or any(not r.finished and not r.output_ids for r in self.reserved) else None
