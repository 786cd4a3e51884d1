"""KVSender <-> KVReceiver for a hybrid (Qwen3.5-style) model in one process: KV pools with a
buffer per full-attention layer only, recurrent-state pools per linear layer, real bootstrap
server and ZMQ, local and Mooncake backends. The request's state slot lands exactly in the
decode's slot before Success, with layer groups and heterogeneous TP too (each decode rank's
linear heads from the prefill ranks that hold them); bytes are counted; aborts fail cleanly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool, StateShape
from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import BootstrapServer
from kvpipe.transfer.control.messages import DecodeRank
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.receiver.kv_receiver import KVReceiver
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.sender.kv_sender import KVSender
from tests.helpers.kv_transfer import CFG, Results, make_backend, wait_for

TYPES = "LLLFLLLF"  # model layers: L linear attention, F full attention
LINEAR = tuple(i for i, t in enumerate(TYPES) if t == "L")
FULL = tuple(i for i, t in enumerate(TYPES) if t == "F")
PAGES, PS, HD, H, SLOTS = 16, 4, 8, 2, 4
S, F = TransferState.SUCCESS, TransferState.FAILED
SRC = np.array([3, 4, 5, 9, 10, 11])  # 22-token prompt


def state_shape(tp: int) -> StateShape:  # 4 key and value heads before TP
    return StateShape(conv_dim=(2 * 4 * 8 + 4 * 8) // tp, conv_len=3, heads=4 // tp, key_dim=8, value_dim=8)


class Rank:
    """One TP rank's KV and state pools, their layouts, registered with its backend."""

    def __init__(self, tp: int, rank: int, backend, seed: int | None) -> None:
        h = H // tp if tp <= H else 1
        h0 = rank * h if tp <= H else rank // (tp // H)
        self.kv = KVPool(len(FULL), PAGES, PS, h, HD)
        self.state = StatePool(LINEAR, SLOTS, state_shape(tp), torch.bfloat16)
        if seed is not None:
            g = torch.Generator().manual_seed(seed + rank)
            for buf in self.kv.buffers() + self.state.conv + self.state.recurrent:
                buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
        self.layout = KVLayout.from_pool(self.kv, head_start=h0, total_kv_heads=H)
        self.state_layout = StateLayout.from_pool(self.state, FULL, len(TYPES), rank, tp)
        backend.register_many(list(self.layout.buffer_addrs), [self.layout.buffer_nbytes] * self.layout.num_buffers)
        addrs, sizes = zip(*self.state_layout.buffers())
        backend.register_many(list(addrs), list(sizes))
        self.backend = backend


def start_pair(stack, kind="local", p_tp=1, d_tp=1, cfg=CFG):
    fabric = LocalFabric()
    server = stack.enter_context(BootstrapServer("127.0.0.1", 0))
    senders, p_ranks = [], []
    for r in range(p_tp):
        rk = Rank(p_tp, r, make_backend(kind, fabric, stack), seed=10)
        s = KVSender(
            cfg,
            layout=rk.layout,
            backend=rk.backend,
            tp_rank=r,
            tp_size=p_tp,
            model_name="m",
            instance_id="p0",
            state_layout=rk.state_layout,
        )
        stack.callback(s.close)
        senders.append(s.start(("127.0.0.1", server.port)))
        p_ranks.append(rk)
    d_ranks = [Rank(d_tp, r, make_backend(kind, fabric, stack), seed=None) for r in range(d_tp)]
    recv = KVReceiver(
        cfg, ranks=[DecodeRank(d.layout, d.backend.address, None, d.state_layout) for d in d_ranks], model_name="m"
    )
    stack.callback(recv.close)
    return server.port, senders, p_ranks, recv.start(), d_ranks


def assert_state_moved(src: Rank, dst: Rank, src_slot: int, dst_slot: int) -> None:
    for a, b in zip(src.state.conv + src.state.recurrent, dst.state.conv + dst.state.recurrent, strict=True):
        assert torch.equal(b[dst_slot], a[src_slot])
        others = [s for s in range(SLOTS) if s != dst_slot]
        assert not b[others].any()


def kv_bytes(rank: Rank, pages: int) -> int:
    return pages * rank.layout.page_nbytes * rank.layout.num_buffers


@pytest.mark.parametrize("kind", ["local", "mooncake"])
def test_state_lands_with_the_last_send(stack, kind):
    port, (sender,), (p,), recv, (d,) = start_pair(stack, kind)
    dst = np.array([7, 8, 0, 1, 2, 12])
    recv.add_room(11, "127.0.0.1", port, dst, prefix_len=0, state_slot=2)
    sender.add_room(11, SRC, state_slot=1)
    assert sender.send(11, 0, 12)  # a chunk: KV of 3 full pages, no state yet
    assert sender.send(11, 12, 22, last=True, aux=(42, -0.25))
    assert Results(sender).get(11) == (11, S, "")
    assert Results(recv).get(11)[1:] == (S, "", m.AuxData(11, 42, -0.25))
    for a, b in zip(p.kv.buffers(), d.kv.buffers(), strict=True):
        assert torch.equal(b[dst], a[SRC])
    assert_state_moved(p, d, 1, 2)
    assert sender.stats.bytes_written == kv_bytes(p, SRC.size) + p.state_layout.slot_nbytes
    # KV: 2 sends x 2 runs (3,4->7,8 | 5->0 and 9,10->1,2 | 11->12) x (2 full layers, K/V);
    # state: one op per (linear layer, conv|recurrent)
    assert sender.stats.ops_submitted == 2 * 2 * 2 * len(FULL) + 2 * len(LINEAR)


def test_layer_groups_send_each_groups_state_once(stack):
    port, (sender,), (p,), recv, (d,) = start_pair(stack)
    dst = np.arange(6)
    recv.add_room(5, "127.0.0.1", port, dst, prefix_len=0, state_slot=3)
    sender.add_room(5, SRC, state_slot=0)
    # the prompt's only forward in two layer groups of model layers: [0, 4) then [4, 8)
    assert sender.send(5, 0, 22, 0, 4, state=True)
    assert sender.send(5, 0, 22, 4, 8, state=True)
    assert sender.send(5, 0, 22, last=True, aux=(7, -1.0))
    assert Results(recv).get(5)[1] is S and Results(sender).get(5)[1] is S
    assert_state_moved(p, d, 0, 3)
    for a, b in zip(p.kv.buffers(), d.kv.buffers(), strict=True):
        assert torch.equal(b[dst], a[SRC])
    assert sender.stats.bytes_written == kv_bytes(p, SRC.size) + p.state_layout.slot_nbytes


def test_same_tp_two_ranks_each_move_their_heads(stack):
    port, senders, p_ranks, recv, d_ranks = start_pair(stack, p_tp=2, d_tp=2)
    dst = np.arange(6) + 2
    recv.add_room(9, "127.0.0.1", port, [dst, dst], prefix_len=0, state_slot=1)
    for s in senders:
        s.add_room(9, SRC, state_slot=3)
        s.send(9, 0, 22, last=True, aux=(1, 0.0))
    assert Results(recv).get(9)[1] is S
    for s, p, d in zip(senders, p_ranks, d_ranks):
        assert Results(s).get(9)[1] is S
        assert_state_moved(p, d, 3, 1)
        assert s.stats.bytes_written == kv_bytes(p, SRC.size) + p.state_layout.slot_nbytes


def global_state(ranks: list[Rank], slot: int) -> list[torch.Tensor]:
    """One slot's state as TP 1 holds it, per (linear layer, conv|recurrent), from TP ranks' pools."""
    out = []
    for i in range(len(LINEAR)):
        convs = [rk.state.conv[i][slot] for rk in ranks]  # [q | k | v of the rank's heads, len]
        qk = convs[0].shape[0] - ranks[0].state.shape.heads * ranks[0].state.shape.value_dim
        out.append(
            torch.cat([c[: qk // 2] for c in convs] + [c[qk // 2 : qk] for c in convs] + [c[qk:] for c in convs])
        )
        out.append(torch.cat([rk.state.recurrent[i][slot] for rk in ranks]))
    return out


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (4, 2), (2, 4)])
def test_heterogeneous_tp_moves_every_linear_head_once(stack, p_tp, d_tp):
    port, senders, p_ranks, recv, d_ranks = start_pair(stack, p_tp=p_tp, d_tp=d_tp)
    dst = np.arange(6) + 1
    recv.add_room(4, "127.0.0.1", port, [dst] * d_tp, prefix_len=0, state_slot=3)
    for s in senders:
        s.add_room(4, SRC, state_slot=0)
        s.send(4, 0, 22, 0, 4, state=True)  # layer groups: the state of linear layers 0..2 first
        s.send(4, 0, 22, last=True, aux=(3, -0.5))
    assert Results(recv).get(4)[1:3] == (S, "")
    for s in senders:
        assert Results(s).get(4)[1] is S
    for a, b in zip(global_state(p_ranks, 0), global_state(d_ranks, 3), strict=True):
        assert torch.equal(b, a)
    for d in d_ranks:
        assert all(not buf[[0, 1, 2]].any() for buf in d.state.conv + d.state.recurrent)
    # KV: each decode rank's heads once (H / d_tp each, or one replicated head when d_tp > H),
    # counted from the layout rather than the planner; state: every linear head of the slot once
    kv = SRC.size * d_tp * max(1, H // d_tp) * PS * HD * 4 * 2 * len(FULL)
    assert sum(s.stats.bytes_written for s in senders) == kv + p_ranks[0].state_layout.slot_nbytes * p_tp


def test_requests_without_a_state_slot_are_refused(stack):
    port, (sender,), _, recv, _ = start_pair(stack)
    with pytest.raises(ValueError, match="state slot"):
        recv.add_room(1, "127.0.0.1", port, np.arange(6), prefix_len=0)
    with pytest.raises(ValueError, match="state slot"):
        recv.add_room(1, "127.0.0.1", port, np.arange(6), prefix_len=0, state_slot=SLOTS)
    with pytest.raises(ValueError, match="state slot"):
        sender.add_room(1, SRC)


def test_decode_abort_fails_both_sides_and_writes_no_state_after(stack):
    port, (sender,), (p,), recv, (d,) = start_pair(stack)
    sender.add_room(3, SRC, state_slot=2)
    recv.add_room(3, "127.0.0.1", port, np.arange(6), prefix_len=0, state_slot=2)
    wait_for(lambda: sender.room_state(3) is TransferState.WAITING_FOR_INPUT, 5, "request bound")
    sender.send(3, 0, 8)
    recv.abort(3, "client went away")
    assert Results(sender).get(3)[1] is F
    assert Results(recv).get(3)[1:3] == (F, "client went away")
    with pytest.raises(KeyError):  # reported and forgotten: nothing more is written
        sender.send(3, 8, 22, last=True, aux=(1, 0.0))
    assert all(not b.any() for b in d.state.conv + d.state.recurrent)
    assert sender.num_active_rooms() == 0 and recv.num_active_rooms() == 0
