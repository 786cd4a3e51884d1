"""A request's recurrent state -> write ops, vectorised over linear layers.

Slot s of a conv buffer is [conv_dim, conv_len] with channels [q | k | v] of the rank's heads;
slot s of a recurrent buffer is [heads, key_dim, value_dim]. Moving the linear heads both ranks
hold (key heads [k0, k1), value heads [v0, v1): their intersection) takes per linear layer
- conv: one op when the moved heads are every head of both ranks (the whole slot, same TP),
  else 3 ops (the q, k and v channel ranges of the moved heads);
- recurrent: one op (a value-head range of one slot is contiguous).
Op order: linear layer-major, conv op(s) before the recurrent op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.planning.op_arrays import OpArrays
from kvpipe.transfer.planning.tp_mapping import head_intersection
from kvpipe.transfer.recurrent.layout import StateLayout


@dataclass(frozen=True, eq=False)
class StatePlan(OpArrays):
    """A request's recurrent-state ops (one slot's conv and recurrent tensors per layer)."""


def common_heads(src: StateLayout, dst: StateLayout) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(key heads, value heads) both ranks hold, or None when they share none."""
    k = head_intersection((src.key_head_start, src.key_head_end), (dst.key_head_start, dst.key_head_end))
    v = head_intersection((src.value_head_start, src.value_head_end), (dst.value_head_start, dst.value_head_end))
    return None if k is None or v is None else (k, v)


def _slot_offsets(lay: StateLayout, k: tuple[int, int], v: tuple[int, int], whole: bool) -> tuple[list[int], list[int]]:
    """Byte offsets inside one slot of the moved heads: (conv ranges, recurrent range), and lengths."""
    ch = lay.conv_len * lay.conv_itemsize  # bytes of one conv channel in one slot
    dk, dv = lay.key_dim, lay.value_dim
    if whole:
        conv = [(0, lay.conv_slot_nbytes)]
    else:
        nk = lay.key_heads
        q0 = (k[0] - lay.key_head_start) * dk
        kv_len = (k[1] - k[0]) * dk
        conv = [
            (q0 * ch, kv_len * ch),
            ((nk * dk + q0) * ch, kv_len * ch),
            ((2 * nk * dk + (v[0] - lay.value_head_start) * dv) * ch, (v[1] - v[0]) * dv * ch),
        ]
    head = dk * dv * 4  # one value head of the fp32 recurrent state
    rec = ((v[0] - lay.value_head_start) * head, (v[1] - v[0]) * head)
    return [o for o, _ in conv] + [rec[0]], [n for _, n in conv] + [rec[1]]


def plan_state(
    src_slot: int, dst_slot: int, src: StateLayout, dst: StateLayout, linear: np.ndarray | list[int] | None = None
) -> StatePlan:
    """Write the heads both ranks hold of source slot `src_slot` into destination slot
    `dst_slot` for the linear layers `linear` (state-pool indices; default all)."""
    reason = src.compatible_with(dst)
    if reason is not None:
        raise ValueError(f"incompatible state layouts: {reason}")
    if not 0 <= src_slot < src.num_slots:
        raise ValueError(f"source state slot {src_slot} outside [0, {src.num_slots})")
    if not 0 <= dst_slot < dst.num_slots:
        raise ValueError(f"destination state slot {dst_slot} outside [0, {dst.num_slots})")
    heads = common_heads(src, dst)
    if heads is None:
        raise ValueError(
            f"no common linear heads: source key heads [{src.key_head_start}, {src.key_head_end}), "
            f"destination [{dst.key_head_start}, {dst.key_head_end})"
        )
    idx = np.arange(src.num_linear, dtype=np.int64) if linear is None else np.asarray(linear, dtype=np.int64).ravel()
    if idx.size and (idx.min() < 0 or idx.max() >= src.num_linear):
        raise ValueError(f"linear layer indices outside [0, {src.num_linear})")
    k, v = heads
    whole = k == (src.key_head_start, src.key_head_end) == (dst.key_head_start, dst.key_head_end) and v == (
        src.value_head_start,
        src.value_head_end,
    ) == (dst.value_head_start, dst.value_head_end)
    s_off, lengths = _slot_offsets(src, k, v, whole)
    d_off, d_len = _slot_offsets(dst, k, v, whole)
    assert lengths == d_len  # the same heads on both sides
    n_conv = len(s_off) - 1

    def addrs(lay: StateLayout, slot: int, off: list[int]) -> np.ndarray:  # [layers, ops per layer]
        conv = np.asarray(lay.conv_addrs, dtype=np.int64)[idx] + slot * lay.conv_slot_nbytes
        rec = np.asarray(lay.recurrent_addrs, dtype=np.int64)[idx] + slot * lay.recurrent_slot_nbytes
        base = np.concatenate([np.repeat(conv[:, None], n_conv, axis=1), rec[:, None]], axis=1)
        return (base + np.asarray(off, dtype=np.int64)[None, :]).ravel()

    length = np.tile(np.asarray(lengths, dtype=np.int64), idx.size)
    return StatePlan(addrs(src, src_slot, s_off), addrs(dst, dst_slot, d_off), length)
