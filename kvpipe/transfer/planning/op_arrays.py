"""Write ops as parallel arrays: op i copies length[i] bytes from src_addr[i] to dst_addr[i].

The shared shape of every plan (KV pages: planner.py's TransferPlan, recurrent state:
recurrent/plan.py's StatePlan, the bench's whole-request plan), which the backends submit as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class OpArrays:
    src_addr: np.ndarray  # [num_ops] int64 absolute addresses in the source process
    dst_addr: np.ndarray  # [num_ops] int64 absolute addresses in the destination process
    length: np.ndarray  # [num_ops] int64 bytes

    @property
    def num_ops(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())
