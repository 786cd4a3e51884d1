"""Recurrent-state transfer of a hybrid model: the layer map (model layers -> KV buffers and
linear layers), the state ops (one per linear layer and conv|recurrent, bytes as predicted),
real copies between two StatePools through the local backend, and the sender room's planning
of state with the KV (per layer group, the rest with the last call, each layer once)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from kvpipe.cache.recurrent_pool import StatePool, StateShape
from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.backends.base import BatchState
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.control.messages import RegisterPeer, TransferRequest
from kvpipe.transfer.lifecycle import RoomRecord
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.recurrent.plan import plan_state
from kvpipe.transfer.sender.peers import SenderPeers
from kvpipe.transfer.sender.plan_types import Destination, PlanError, SendCall
from kvpipe.transfer.sender.room import SenderRoom

TYPES = "LLLFLLLF"  # Qwen3.5's default pattern: every 4th layer full attention
LINEAR = tuple(i for i, t in enumerate(TYPES) if t == "L")
FULL = tuple(i for i, t in enumerate(TYPES) if t == "F")
SHAPE = StateShape(conv_dim=40, conv_len=3, heads=2, key_dim=8, value_dim=4)  # 2 key heads: q, k 16 channels, v 8
HALF = StateShape(conv_dim=20, conv_len=3, heads=1, key_dim=8, value_dim=4)  # one rank's of TP 2
SLOTS = 5


def make_pool(seed: int | None, shape: StateShape = SHAPE, dtype=torch.bfloat16) -> StatePool:
    pool = StatePool(LINEAR, SLOTS, shape, dtype)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for buf in pool.conv + pool.recurrent:
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    return pool


def layout(pool: StatePool) -> StateLayout:
    return StateLayout.from_pool(pool, FULL, len(TYPES))


def test_layout_from_pool_matches_buffer_infos():
    pool = make_pool(None)
    lay = layout(pool)
    infos = pool.buffer_infos()
    assert [b.addr for b in infos] == [a for pair in zip(lay.conv_addrs, lay.recurrent_addrs) for a in pair]
    assert [b.slot_nbytes for b in infos] == [lay.conv_slot_nbytes, lay.recurrent_slot_nbytes] * len(LINEAR)
    assert lay.buffers() == [(b.addr, b.nbytes) for b in infos]
    assert lay.slot_nbytes == pool.slot_nbytes == len(LINEAR) * (40 * 3 * 2 + 2 * 8 * 4 * 4)


@pytest.mark.parametrize(
    "a,b,kv,lin",
    [
        (0, 8, (0, 2), (0, 6)),
        (0, 3, (0, 0), (0, 3)),
        (0, 4, (0, 1), (0, 3)),
        (3, 4, (0, 1), (3, 3)),
        (4, 8, (1, 2), (3, 6)),
        (2, 6, (0, 1), (2, 5)),
        (5, 5, (1, 1), (4, 4)),
    ],
)
def test_layer_groups_map_to_kv_buffers_and_linear_layers(a, b, kv, lin):
    lay = layout(make_pool(None))
    assert lay.kv_range(a, b) == kv and lay.linear_range(a, b) == lin
    with pytest.raises(ValueError):
        lay.kv_range(0, 9)


def test_layout_invariants_and_compatibility():
    lay = layout(make_pool(None))
    with pytest.raises(ValueError, match="partition"):
        StateLayout.from_pool(make_pool(None), (3,), len(TYPES))
    other = layout(make_pool(None))
    assert lay.compatible_with(other) is None
    half = StateLayout.from_pool(make_pool(None, HALF), FULL, len(TYPES), 1, 2)  # TP 2 rank 1: the same model
    assert lay.compatible_with(half) is None and (half.key_head_start, half.value_head_start) == (1, 1)
    other_model = layout(make_pool(None, HALF))  # TP 1 with half the heads
    assert "linear key heads" in lay.compatible_with(other_model)
    f32 = layout(make_pool(None, dtype=torch.float32))
    assert "dtype" in lay.compatible_with(f32)


@pytest.mark.parametrize("linear", [None, [0, 1, 2], [4], []])
def test_state_ops_and_bytes_as_predicted_and_copies_exact(linear):
    src, dst = make_pool(1), make_pool(None)
    sl, dl = layout(src), layout(dst)
    plan = plan_state(3, 1, sl, dl, linear)
    n = len(LINEAR) if linear is None else len(linear)
    assert plan.num_ops == 2 * n  # one op per (linear layer, conv|recurrent): a slot is contiguous
    assert plan.nbytes == n * (sl.conv_slot_nbytes + sl.recurrent_slot_nbytes)
    fabric = LocalFabric()
    tx, rx = LocalBackend(fabric), LocalBackend(fabric)
    for be, lay in ((tx, sl), (rx, dl)):
        addrs, sizes = zip(*lay.buffers())
        be.register_many(list(addrs), list(sizes))
    if plan.num_ops:
        assert tx.wait(tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)) is BatchState.DONE
    moved = set(range(len(LINEAR)) if linear is None else linear)
    for i in range(len(LINEAR)):
        for s, d in ((src.conv[i], dst.conv[i]), (src.recurrent[i], dst.recurrent[i])):
            if i in moved:
                assert torch.equal(d[1], s[3])
            else:
                assert not d[1].any()
            assert not d[[0, 2, 3, 4]].any()  # other slots untouched


def test_plan_state_refuses_bad_slots_and_layouts():
    sl = layout(make_pool(None))
    with pytest.raises(ValueError, match="source state slot"):
        plan_state(SLOTS, 0, sl, sl)
    with pytest.raises(ValueError, match="destination state slot"):
        plan_state(0, SLOTS, sl, sl)
    with pytest.raises(ValueError, match="incompatible"):
        plan_state(0, 0, sl, layout(make_pool(None, HALF)))


def global_state(pools: list[StatePool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per linear layer the TP-1 view of TP ranks' pools: conv [slots, q | k | v of all heads, len]
    and recurrent [slots, all heads, Dk, Dv]."""
    out = []
    for i in range(len(LINEAR)):
        convs = [p.conv[i] for p in pools]
        qk = convs[0].shape[1] - pools[0].shape.heads * pools[0].shape.value_dim
        h = qk // 2
        conv = torch.cat([c[:, :h] for c in convs] + [c[:, h:qk] for c in convs] + [c[:, qk:] for c in convs], 1)
        out.append((conv, torch.cat([p.recurrent[i] for p in pools], 1)))
    return out


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_heterogeneous_tp_moves_each_decode_ranks_heads_once(p_tp, d_tp):
    shape = {1: SHAPE, 2: HALF}
    src = [make_pool(7 + r, shape[p_tp]) for r in range(p_tp)]
    dst = [make_pool(None, shape[d_tp]) for _ in range(d_tp)]
    sls = [StateLayout.from_pool(p, FULL, len(TYPES), r, p_tp) for r, p in enumerate(src)]
    dls = [StateLayout.from_pool(p, FULL, len(TYPES), r, d_tp) for r, p in enumerate(dst)]
    fabric = LocalFabric()
    tx, rx = LocalBackend(fabric), LocalBackend(fabric)
    for be, lays in ((tx, sls), (rx, dls)):
        for lay in lays:
            addrs, sizes = zip(*lay.buffers())
            be.register_many(list(addrs), list(sizes))
    total = 0
    for r in range(d_tp):  # the TP mapping's pairs: every prefill rank sharing heads with decode rank r
        for p in range(p_tp):
            if p_tp >= d_tp and p // (p_tp // d_tp) != r or p_tp < d_tp and r // (d_tp // p_tp) != p:
                continue
            plan = plan_state(2, 4, sls[p], dls[r])
            whole = p_tp == d_tp
            assert plan.num_ops == len(LINEAR) * (2 if whole else 4)  # conv: 1 op, or q, k, v ranges
            assert tx.wait(tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)) is BatchState.DONE
            total += plan.nbytes
    assert total == layout(make_pool(None)).slot_nbytes  # every head of the slot once
    for (sc, sr), (dc, dr) in zip(global_state(src), global_state(dst), strict=True):
        assert torch.equal(dc[4], sc[2]) and torch.equal(dr[4], sr[2])
        assert not dc[[0, 1, 2, 3]].any() and not dr[[0, 1, 2, 3]].any()


# ---- the sender room: KV of full layers and state of linear layers, per layer group ----------

PS, PAGES = 4, 16


def kv_layout(base: int) -> KVLayout:
    nbytes = PAGES * 2 * PS * 8 * 4
    return KVLayout(
        num_layers=len(FULL),
        page_size=PS,
        kv_heads=2,
        head_start=0,
        total_kv_heads=2,
        head_dim=8,
        dtype="float32",
        itemsize=4,
        buffer_addrs=tuple(base + i * nbytes for i in range(2 * len(FULL))),
        buffer_nbytes=nbytes,
    )


def room_with_dest(
    src_state: StateLayout, dst_state: StateLayout, dst_slot: int | None = 2
) -> tuple[SenderRoom, Destination]:
    src_kv, dst_kv = kv_layout(1 << 30), kv_layout(1 << 32)
    r = SenderRoom(
        7,
        RoomRecord.new(7, {}, 0.0),
        src_kv,
        src_state,
        src_pages=np.arange(3, dtype=np.int64),
        src_state_slot=4,
        expected=1,
    )
    d = Destination(
        "d/0",
        0,
        "ctl",
        "peer",
        dst_kv,
        np.arange(5, 8, dtype=np.int64),
        0,
        (0, 2),
        np.zeros(len(FULL), dtype=np.int64),
        None,
        dst_state,
        dst_slot,
        np.zeros(dst_state.num_linear, dtype=bool),
    )
    r.dests[d.session_id] = d
    return r, d


def planned(r: SenderRoom) -> tuple[int, int]:
    ops = sum(b.num_ops for b in r.queued)
    nbytes = sum(int(b.length.sum()) for b in r.queued)
    r.queued.clear()
    return ops, nbytes


def test_room_sends_group_state_then_the_rest_with_the_last_call():
    sl, dl = layout(make_pool(None)), layout(make_pool(None))
    r, d = room_with_dest(sl, dl)
    state_bytes = sl.conv_slot_nbytes + sl.recurrent_slot_nbytes
    page = r.layout.page_nbytes
    # group [0, 4) of the prompt's last forward: KV buffer 0 (full layer 3), state of linear 0..2
    r.add_call(SendCall(0, 10, *sl.kv_range(0, 4), False, None, sl.linear_range(0, 4)))
    r.plan(chunk_ops=1000)
    # KV: 2 full pages (a partial page waits for the last call), one run -> K and V: 2 ops
    assert planned(r) == (2 + 3 * 2, 2 * 2 * page + 3 * state_bytes)
    assert d.state_sent.tolist() == [True] * 3 + [False] * 3
    # a group without full layers: state only
    r.add_call(SendCall(0, 10, *sl.kv_range(4, 7), False, None, sl.linear_range(4, 7)))
    r.plan(chunk_ops=1000)
    assert planned(r) == (3 * 2, 3 * state_bytes)
    # the last call: all KV layers flush, the state already sent is not sent again
    r.add_call(SendCall(0, 10, 0, len(FULL), True))
    r.plan(chunk_ops=1000)
    ops, nbytes = planned(r)
    assert (ops, nbytes) == (2 + 2, 2 * page + 2 * 3 * page)  # layer 0's partial page, layer 1's three pages
    assert d.state_sent.all()


def test_room_without_groups_sends_all_state_with_the_last_call_to_the_decode_slot():
    sl, dl = layout(make_pool(None)), layout(make_pool(None))
    r, d = room_with_dest(sl, dl, dst_slot=2)
    r.add_call(SendCall(0, 10, 0, len(FULL), True))
    r.plan(chunk_ops=1000)
    state = [b for b in r.queued if b.num_ops == 2 * len(LINEAR)]
    assert len(state) == 1
    b = state[0]
    assert b.src.tolist()[:2] == [
        sl.conv_addrs[0] + 4 * sl.conv_slot_nbytes,
        sl.recurrent_addrs[0] + 4 * sl.recurrent_slot_nbytes,
    ]
    assert b.dst.tolist()[:2] == [
        dl.conv_addrs[0] + 2 * dl.conv_slot_nbytes,
        dl.recurrent_addrs[0] + 2 * dl.recurrent_slot_nbytes,
    ]
    assert planned(r)[0] == 2 * 2 + 2 * len(LINEAR)  # KV: one run of 3 pages x (2 layers, K/V)


def test_room_without_a_decode_state_slot_fails_planning():
    sl = layout(make_pool(None))
    r, _ = room_with_dest(sl, sl, dst_slot=None)
    r.add_call(SendCall(0, 10, 0, len(FULL), True))
    with pytest.raises(PlanError, match="state slot"):
        r.plan(chunk_ops=1000)


def test_state_batches_split_by_chunk_ops():
    sl = layout(make_pool(None))
    r, _ = room_with_dest(sl, sl)
    r.add_call(SendCall(0, 8, 0, len(FULL), True))
    r.plan(chunk_ops=4)
    assert max(b.num_ops for b in r.queued) <= 4
    counts = collections.Counter(b.peer for b in r.queued)
    assert counts["peer"] == len(r.queued)


# ---- registration: the prefill refuses pairings it cannot serve ---------------------------------


def test_prefill_refuses_hybrid_pairings_it_cannot_serve():
    sl = layout(make_pool(None))
    kv = kv_layout(1 << 30)
    peers = SenderPeers(DisaggregationConfig(), kv, 0, 1, sl)

    def reg(session: str, tp_size: int = 1, state: StateLayout | None = sl) -> str | None:
        # a data address per session: one already registered by a live decode with other buffers
        # is refused for that reason (issue 30), before the pairing checks this test is about
        return peers.register(RegisterPeer(session, 0, tp_size, f"data-{session}", "ctl", kv, None, state), 0.0)

    assert reg("ok") is None
    assert "only the prefill" in reg("no-state", state=None)
    assert "linear key heads" in reg("other-model", state=layout(make_pool(None, HALF)))
    _, why = peers.check_request(TransferRequest(1, "ok", (1, 2), 0, 0))
    assert "needs a decode state slot" in why
    _, why = peers.check_request(TransferRequest(1, "ok", (1, 2), 0, 0, state_slot=SLOTS))
    assert "outside the decode pool" in why
    assert peers.check_request(TransferRequest(1, "ok", (1, 2), 0, 0, state_slot=SLOTS - 1))[1] is None
