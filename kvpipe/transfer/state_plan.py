"""A request's recurrent state -> write ops: one op per (linear layer, conv|recurrent), vectorised.

Both ranks hold the same heads (StateLayout.compatible_with), so slot `src_slot` of each source
buffer is one contiguous run that lands whole at slot `dst_slot` of the same destination buffer.
Op order: linear layer-major, conv before recurrent (like StatePool.buffer_infos).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.state_layout import StateLayout


@dataclass(frozen=True, eq=False)
class StatePlan:
    src_addr: np.ndarray  # [num_ops] int64
    dst_addr: np.ndarray  # [num_ops] int64
    length: np.ndarray  # [num_ops] int64 bytes

    @property
    def num_ops(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


def plan_state(src_slot: int, dst_slot: int, src: StateLayout, dst: StateLayout,
               linear: np.ndarray | list[int] | None = None) -> StatePlan:
    """Write source slot `src_slot` into destination slot `dst_slot` for the linear layers
    `linear` (state-pool indices; default all): 2 ops per layer."""
    reason = src.compatible_with(dst)
    if reason is not None:
        raise ValueError(f"incompatible state layouts: {reason}")
    if not 0 <= src_slot < src.num_slots:
        raise ValueError(f"source state slot {src_slot} outside [0, {src.num_slots})")
    if not 0 <= dst_slot < dst.num_slots:
        raise ValueError(f"destination state slot {dst_slot} outside [0, {dst.num_slots})")
    idx = np.arange(src.num_linear, dtype=np.int64) if linear is None else np.asarray(linear, dtype=np.int64).ravel()
    if idx.size and (idx.min() < 0 or idx.max() >= src.num_linear):
        raise ValueError(f"linear layer indices outside [0, {src.num_linear})")
    conv, rec = src.conv_slot_nbytes, src.recurrent_slot_nbytes  # equal on both sides (compatible)

    def bases(layout: StateLayout, slot: int) -> np.ndarray:  # [len(idx), 2]: conv, recurrent
        c = np.asarray(layout.conv_addrs, dtype=np.int64)[idx] + slot * conv
        r = np.asarray(layout.recurrent_addrs, dtype=np.int64)[idx] + slot * rec
        return np.stack([c, r], axis=1)

    length = np.tile(np.asarray([conv, rec], dtype=np.int64), idx.size)
    return StatePlan(bases(src, src_slot).ravel(), bases(dst, dst_slot).ravel(), length)
