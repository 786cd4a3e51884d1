"""The KV transfer agent of a TP child rank (rank >= 1) of a PD server, and its typed messages.

Every TP rank holds a shard of the KV pool (its KV heads), so every rank moves its own KV:
- prefill: the child runs its own `KVSender` (tp_rank r of N, the instance id rank 0 chose),
  registered with rank 0's bootstrap server, and replays rank 0's engine calls (add_room, send,
  abort) in order; it pushes back the rooms its sender reports (RoomsDone) and its counters;
- decode: the child registers its pool with its own backend and tells rank 0 the (layout, data
  address) that rank 0's KVReceiver hands to prefill ranks as this rank's destination.

The agent runs on its own thread and its own socketpair ("agent channel"), never on the step
pipe: the child's main thread is blocked inside the forward's collectives while rank 0 issues
per-layer-group sends, and those must not wait for the forward to end.

    rank 0 -> child: AgentStart, then (prefill) AddRoom / SendKV / AbortRoom ..., CloseAgent
    child -> rank 0: AgentReady | AgentFailed, then (prefill) RoomsDone ...
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np

from kvpipe.config import ParallelConfig, ServerConfig
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.sender_book import SenderStats
from kvpipe.transfer.state import TransferState

if TYPE_CHECKING:
    from kvpipe.cache.kv_pool import KVPool
    from kvpipe.transfer.backends.base import TransferBackend
    from kvpipe.transfer.sender import KVSender

logger = logging.getLogger(__name__)

POLL_S = 0.002  # prefill child: how often its sender is polled while no call arrives
STATS_EVERY_S = 0.5  # ... and how often changed counters are pushed without a finished room


# ---- rank 0 -> child ------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentStart:
    instance_id: str | None = None  # prefill: shared by all ranks of the instance
    bootstrap: tuple[str, int] | None = None  # prefill: the bootstrap server to register with


@dataclass(frozen=True)
class AddRoom:
    room: int
    pages: np.ndarray  # int64 page table (the same page ids on every rank: one scheduler)


@dataclass(frozen=True)
class SendKV:  # KVSender.send arguments; forwarded only once the KV is ready on every rank
    room: int
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int | None
    last: bool
    aux: tuple[int, float] | None
    src_pages: np.ndarray | None


@dataclass(frozen=True)
class AbortRoom:
    room: int
    reason: str


@dataclass(frozen=True)
class CloseAgent:
    pass


# ---- child -> rank 0 ------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentReady:
    rank: int
    layout: KVLayout  # this rank's pool (its head range)
    data_address: str  # its backend's address
    control_address: str | None  # prefill: its KVSender's control endpoint


@dataclass(frozen=True)
class AgentFailed:
    rank: int
    text: str


@dataclass(frozen=True)
class RoomsDone:
    rank: int
    results: tuple[tuple[int, TransferState, str], ...]  # what the child's KVSender.poll reported
    stats: SenderStats  # a snapshot of its counters


def rank_layout(cfg: ServerConfig, rank: int, pool: "KVPool", total_kv_heads: int) -> KVLayout:
    """A TP rank's pool as the transfer layer sees it: its KV head range among all KV heads."""
    start = ParallelConfig(cfg.tp_size, rank).kv_head_start(total_kv_heads)
    return KVLayout.from_pool(pool, start, total_kv_heads)


class ChildAgent:
    """The transfer agent of TP rank `rank` >= 1 (lives in the child process, on its own thread)."""

    def __init__(self, cfg: ServerConfig, rank: int, pool: "KVPool", total_kv_heads: int, conn: Connection) -> None:
        self.cfg, self.rank, self.conn = cfg, rank, conn
        self.pool, self.total_kv_heads = pool, total_kv_heads  # this rank's KV shard, the model's KV heads
        self.backend: TransferBackend | None = None
        self.sender: KVSender | None = None
        self._failed: list[tuple[int, TransferState, str]] = []  # rooms refused locally, reported next
        self._closed = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"kv-agent-{rank}", daemon=True)

    def start(self) -> "ChildAgent":
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            start = self.conn.recv()
            if isinstance(start, CloseAgent):
                return
            self.conn.send(self._setup(start))
            self._loop()
        except (EOFError, OSError):
            pass  # rank 0 is gone or closed the channel: the step pipe ends this process
        except BaseException:  # noqa: BLE001 - reported to rank 0, which fails this rank's rooms
            text = traceback.format_exc()
            logger.error("TP rank %d transfer agent failed:\n%s", self.rank, text)
            try:
                self.conn.send(AgentFailed(self.rank, text))
            except (OSError, ValueError):
                pass
        finally:
            self.close()

    def _setup(self, start: AgentStart) -> AgentReady:
        from kvpipe.engine.disagg import data_host, make_backend, register_pool
        from kvpipe.transfer.sender import KVSender

        layout = rank_layout(self.cfg, self.rank, self.pool, self.total_kv_heads)
        self.backend = make_backend(self.cfg)
        register_pool(self.backend, layout)
        control = None
        if self.cfg.disaggregation.mode == "prefill":
            if start.instance_id is None or start.bootstrap is None:
                raise ValueError("a prefill TP rank needs the instance id and the bootstrap address")
            self.sender = KVSender(self.cfg.disaggregation, layout=layout, backend=self.backend,
                                   tp_rank=self.rank, tp_size=self.cfg.tp_size, model_name=self.cfg.model_name,
                                   instance_id=start.instance_id, host=data_host(self.cfg))
            self.sender.start(bootstrap=start.bootstrap)
            control = self.sender.control_address
        return AgentReady(self.rank, layout, self.backend.address, control)

    def _loop(self) -> None:
        sent_stats: SenderStats | None = None
        next_stats = 0.0
        while True:
            # decode ranks have nothing to poll: wait for CloseAgent (or EOF)
            if self.conn.poll(POLL_S if self.sender is not None else None):
                msg = self.conn.recv()
                if isinstance(msg, CloseAgent):
                    return
                self._dispatch(msg)
                if self.conn.poll(0):
                    continue  # calls first: a room's whole burst lands in the sender together
            if self.sender is None:
                continue
            done = self._failed + self.sender.poll()
            self._failed = []
            now = time.monotonic()
            stats = replace(self.sender.stats)
            if done or (now >= next_stats and stats != sent_stats):
                self.conn.send(RoomsDone(self.rank, tuple(done), stats))
                sent_stats, next_stats = stats, now + STATS_EVERY_S

    def _dispatch(self, msg: object) -> None:
        s = self.sender
        if s is None:
            raise TypeError(f"TP rank {self.rank} has no KV sender for {type(msg).__name__}")
        if isinstance(msg, AddRoom):
            try:
                s.add_room(msg.room, msg.pages)
            except ValueError as e:  # nothing of this room is in our sender: report it failed now
                self._failed.append((msg.room, TransferState.FAILED, f"add_room refused: {e}"))
        elif isinstance(msg, SendKV):
            try:
                s.send(msg.room, msg.token_start, msg.token_end, msg.layer_start, msg.layer_end, msg.last,
                       msg.aux, msg.src_pages)
            except KeyError:
                pass  # the room never entered our sender: its add_room failure is reported already
            except ValueError as e:
                s.abort(msg.room, f"send on TP rank {self.rank} failed: {e}")
        elif isinstance(msg, AbortRoom):
            s.abort(msg.room, msg.reason)
        else:
            raise TypeError(f"unexpected {type(msg).__name__} on the agent channel of TP rank {self.rank}")

    def close(self) -> None:
        """Stop the sender and drop the backend (idempotent; any thread)."""
        if not self._closed.acquire(blocking=False):
            return
        if self.sender is not None:
            self.sender.close()
        if self.backend is not None:
            self.backend.close()
