"""The dense SwiGLU MLP, tensor-parallel by its intermediate dim."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.cpu.fused_projections import fuse_linears
from kvpipe.model.layers.linear import Linear, Shard


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), split over TP ranks by the intermediate dim.

    all_reduce=False leaves down_proj's partial sums unreduced, for a caller (an MoE block)
    that adds several MLPs' outputs and reduces once.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelConfig,
        group: dist.ProcessGroup | None,
        all_reduce: bool = True,
    ) -> None:
        super().__init__()
        if intermediate_size % parallel.tp_size:
            raise ConfigError(f"intermediate size {intermediate_size} does not split over tp_size={parallel.tp_size}")
        inter = intermediate_size // parallel.tp_size
        i0 = parallel.tp_rank * inter
        rows = Shard.rows(parallel, i0, inter)
        self.gate_proj = Linear(hidden_size, inter, shard=rows)
        self.up_proj = Linear(hidden_size, inter, shard=rows)
        self.down_proj = Linear(
            inter,
            hidden_size,
            all_reduce=all_reduce and parallel.tp_size > 1,
            group=group,
            shard=Shard.cols(parallel, i0, inter),
        )
        self.inter = inter
        # gate/up as one Linear once loaded (fuse_projections; fused_projections.py), else None
        self.gate_up: Linear | None = None

    def fuse_projections(self) -> bool:
        """Fuse gate/up into `gate_up` (after loading, before packing); False where they stay apart."""
        if self.gate_up is None:
            self.gate_up = fuse_linears([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.inter, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
