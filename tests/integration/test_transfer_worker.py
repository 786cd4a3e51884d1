"""A TP rank's TransferWorker in-process (rank 1 of TP 2, the local backend): start-up (backend,
pool registration, a KVSender registered with a real bootstrap server), the step's rooms started
inside the forward, commands between forwards, rooms reported back, refusals reported instead of
lost; a decode rank only registers its pool."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import CacheConfig, DisaggregationConfig, ServerConfig
from kvpipe.disagg.commands import (
    AbortRooms,
    ChunkSend,
    FailRooms,
    PrefillStep,
    RankReport,
    RankStarted,
    RoomStart,
    SendChunks,
    StartDecode,
    StartPrefill,
)
from kvpipe.disagg.transfer_worker import TransferWorker
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.control.bootstrap import BootstrapServer, fetch_prefill_rank
from kvpipe.transfer.lifecycle import TransferState

PAGES, PS = 16, 4


def make(mode: str) -> TransferWorker:
    cfg = ServerConfig(
        "m",
        tp_size=2,
        cache=CacheConfig(page_size=PS, num_pages=PAGES),
        disaggregation=DisaggregationConfig(mode=mode, transfer_backend="local", bootstrap_port=0),
    )
    pool = KVPool(2, PAGES, PS, 1, 8)  # rank 1 of TP 2 over 2 KV heads: one head
    return TransferWorker(cfg, 1, pool, 2, LocalBackend(LocalFabric()))


def results(w: TransferWorker, n: int, timeout_s: float = 10.0) -> dict[int, tuple[TransferState, str]]:
    out: dict[int, tuple[TransferState, str]] = {}
    end = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < end, f"only {out} reported"
        rep = w.poll()
        if rep is not None:
            assert isinstance(rep, RankReport) and rep.rank == 1 and rep.timings == ()  # only rank 0 reports timings
            out.update((room, (state, why)) for room, state, why in rep.results)
        time.sleep(0.005)
    return out


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


def test_prefill_worker_starts_rooms_in_the_forward_and_reports_them(bootstrap: BootstrapServer) -> None:
    w = make("prefill")
    try:
        started = w.handle(StartPrefill("inst-1", ("127.0.0.1", bootstrap.port)))
        assert isinstance(started, RankStarted) and started.rank == 1 and w.poll_interval_s is not None
        assert (started.layout.head_start, started.layout.kv_heads, started.layout.total_kv_heads) == (1, 1, 2)
        info = fetch_prefill_rank("127.0.0.1", bootstrap.port, 1)
        assert (info.instance_id, info.tp_size, info.control_address) == ("inst-1", 2, started.control_address)
        assert w.sender is not None and w.sender.session_id == "inst-1/1"

        step = PrefillStep(
            start=(RoomStart(5, np.arange(3)), RoomStart(6, np.array([PAGES + 1]))), grouped=(ChunkSend(5, 0, 8),)
        )
        w.before_forward(step)  # room 6's pages are outside the pool: refused, reported failed
        w.after_layers(step, 0, 1)  # a grouped send of a room whose decode is not known yet: queued
        assert w.sender.room_state(5) is TransferState.BOOTSTRAPPING and w.sender.room_state(6) is None
        w.handle(SendChunks((ChunkSend(6, 0, 4, last=True, aux=(1, -0.5)),)))  # never had it: ignored
        w.handle(AbortRooms(((5, "decode went away"),)))
        w.handle(FailRooms(((9, "prefill failed: rejected"),)))  # unknown here: added empty, then failed
        got = results(w, 3)
        assert got[5] == (TransferState.FAILED, "decode went away")
        assert got[6][0] is TransferState.FAILED and "add_room refused on TP rank 1" in got[6][1]
        assert got[9] == (TransferState.FAILED, "prefill failed: rejected")
        assert w.sender.num_active_rooms() == 0
        with pytest.raises(TypeError, match="unexpected"):
            w.handle("bogus")
    finally:
        w.close()


def test_decode_worker_registers_its_pool_only() -> None:
    w = make("decode")
    try:
        started = w.handle(StartDecode())
        assert isinstance(started, RankStarted) and started.control_address is None
        assert w.backend is not None and started.data_address == w.backend.address
        assert started.layout.head_start == 1 and started.layout.num_pages == PAGES
        assert w.poll_interval_s is None and w.poll() is None
        w.before_forward(None)
        w.after_layers(None, 0, 2)  # decode forwards carry no meta: nothing to do
        with pytest.raises(TypeError, match="no KV sender"):
            w.handle(AbortRooms(((1, "x"),)))
    finally:
        w.close()
