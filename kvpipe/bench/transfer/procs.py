"""The two process bodies of `kvpipe bench transfer` (same TP): a decode side that owns the
destination KVPool and a prefill side that plans and writes pages into it, both over a real
Mooncake engine, run by process_pair.py.

A sliding-window shape (GPT-OSS) builds both pools as the engine does (KVPool swa_layers: the
n-th sliding layer shares the n-th full layer's tensors) and moves a request as PD does: the
full layers every page, the sliding layers the pages of the prompt's last window, whose ids the
decode takes apart from its full pages (decode_window_table); the digest covers exactly those
pages and the raw patterns move the same total bytes.

A hybrid shape (Qwen3.5) adds a StatePool on both sides: a request then moves the KV pages of
the full-attention layers plus its recurrent-state slot (plan_state: one op per linear layer and
conv|recurrent), submitted as one batch, digested like the pages; the raw patterns move the same
total bytes.

Per prompt length the prefill side (1) writes the request once and checks the digest, (2) sweeps
the raw patterns (raw_mooncake.py: pieces x window over one contiguous range of the same bytes),
repeat by repeat in rotating order, and picks the fastest by median, then (3) times in rotating
order, repeat by repeat: kvpipe (planner + backend, split at `max_op_bytes`), kvpipe split at
each of `compare_max_op_bytes` (0: unsplit), one raw op of all the bytes, and the best raw pattern
again, so the kvpipe / best-raw ratio comes from interleaved runs and not from the sweep's
luckiest median.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from kvpipe.bench.transfer.config import WorkerConfig
from kvpipe.bench.transfer.messages import (
    DecodePool,
    DigestPages,
    PagesDigest,
    PoolZeroed,
    ProtocolError,
    Quit,
    ZeroPool,
)
from kvpipe.bench.transfer.process_pair import Peer
from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import ParallelConfig
from kvpipe.disagg.setup import register_pool
from kvpipe.model.layers.gated_delta_net import local_state_shape
from kvpipe.transfer.backends.mooncake import MooncakeBackend
from kvpipe.transfer.control.messages import RegisterPeer, encode
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout

# A request's state goes from prefill slot SRC_SLOT to decode slot DST_SLOT of pools of STATE_SLOTS:
# a nonzero destination slot checks that the plan addresses slots, not just buffer bases.
STATE_SLOTS, SRC_STATE_SLOT, DST_STATE_SLOT = 2, 0, 1


@dataclass(frozen=True, eq=False)
class Pools:
    """One process's engine and what it registered: the KV pool, a hybrid shape's state pool and
    its layout, and the raw-transfer buffer."""

    backend: MooncakeBackend
    pool: KVPool
    state: StatePool | None
    state_layout: StateLayout | None
    raw: np.ndarray

    @property
    def layout(self) -> KVLayout:
        return KVLayout.from_pool(self.pool)


def setup(cfg: WorkerConfig, num_pages: int) -> Pools:
    backend = MooncakeBackend(hostname=cfg.hostname, protocol="tcp", window=cfg.window, max_op_bytes=cfg.max_op_bytes)
    pool = KVPool(
        cfg.num_layers,
        num_pages,
        cfg.page_size,
        cfg.kv_heads,
        cfg.head_dim,
        dtype=getattr(torch, cfg.dtype),
        latent=cfg.latent,
        swa_layers=cfg.sliding_layers,
    )
    state = _state_pool(cfg, getattr(torch, cfg.dtype))
    state_layout = None if state is None else _state_layout(cfg, state)
    layout = KVLayout.from_pool(pool)
    register_pool(backend, layout, state_layout)
    # Raw-transfer buffer as big as the largest request (every page of every layer bounds a
    # sliding shape's window); np.ones touches every page of it.
    raw = np.ones(
        cfg.max_pages * layout.page_nbytes * layout.num_buffers + (0 if state is None else state.slot_nbytes),
        dtype=np.uint8,
    )
    backend.register_many([raw.ctypes.data], [raw.nbytes])
    return Pools(backend, pool, state, state_layout, raw)


def _state_pool(cfg: WorkerConfig, conv_dtype: torch.dtype) -> StatePool | None:
    """A hybrid shape's state pool (TP 1: every linear head), None for a KV-only shape."""
    if cfg.hybrid is None:
        return None
    if len(cfg.hybrid.full_layers) != cfg.num_layers:
        raise ValueError(f"{cfg.num_layers} KV layers but the layer map has {len(cfg.hybrid.full_layers)}")
    return StatePool(cfg.hybrid.linear_layers, STATE_SLOTS, local_state_shape(cfg.hybrid, ParallelConfig()), conv_dtype)


def _state_layout(cfg: WorkerConfig, state: StatePool) -> StateLayout:
    assert cfg.hybrid is not None
    return StateLayout.from_pool(state, cfg.hybrid.full_layers, len(cfg.hybrid.layer_types))


def state_buffers(state: StatePool | None) -> list[torch.Tensor]:
    return [] if state is None else state.conv + state.recurrent


def digest(
    pool: KVPool,
    pages: np.ndarray,
    state: StatePool | None = None,
    slot: int = 0,
    swa_pages: np.ndarray | None = None,
) -> str:
    """Of the pages' KV and, for a hybrid shape, of state slot `slot` (conv and recurrent). A
    sliding shape: its full layers at `pages`, its sliding layers at the held entries of the
    window table `swa_pages` (the very pages moved)."""
    h = hashlib.blake2b(digest_size=16)
    idx = torch.from_numpy(pages)
    swa = set(pool.swa_layers)
    win = None if swa_pages is None else torch.from_numpy(swa_pages[swa_pages >= 0])
    for layer in range(pool.num_layers):
        at = idx if layer not in swa else win
        assert at is not None, "a sliding layer needs the window table"
        for _, buf in pool.layer_buffers(layer):
            h.update(buf[at].contiguous().view(torch.uint8).numpy().tobytes())
    for buf in state_buffers(state):
        h.update(buf[slot].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def decode_main(cfg: WorkerConfig, peer: Peer) -> None:
    """Receiver: registers its pool once, then zeroes and digests it when asked, until Quit."""
    side = setup(cfg, cfg.pool_pages)
    try:
        reg = RegisterPeer(
            f"bench-decode-{uuid.uuid4().hex[:8]}",
            0,
            1,
            side.backend.address,
            "pipe",
            side.layout,
            state=side.state_layout,
        )
        peer.send(DecodePool(encode(reg), side.raw.ctypes.data))
        while True:
            msg = peer.recv()
            if isinstance(msg, ZeroPool):
                for buf in side.pool.buffers() + state_buffers(side.state):
                    buf.zero_()
                peer.send(PoolZeroed())
            elif isinstance(msg, DigestPages):
                peer.send(PagesDigest(digest(side.pool, msg.pages, side.state, DST_STATE_SLOT, msg.window_table)))
            elif isinstance(msg, Quit):
                break
            else:
                raise ProtocolError(f"the decode got {type(msg).__name__}")
    finally:
        side.backend.close()
