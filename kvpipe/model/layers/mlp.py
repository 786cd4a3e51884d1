"""The dense gated MLP (SwiGLU, or Gemma's GeGLU), tensor-parallel by its intermediate dim."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.cpu.fused_projections import fuse_linears
from kvpipe.model.layers.linear import Linear, Shard


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ModelConfig.hidden_act -> the gate's activation (HF's ACT2FN names)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), split over TP ranks by the intermediate dim: SwiGLU (silu),
    or GeGLU (gelu_pytorch_tanh: Gemma).

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
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ConfigError(f"hidden_act={activation!r} is not supported (only {', '.join(ACTIVATIONS)})")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
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
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
