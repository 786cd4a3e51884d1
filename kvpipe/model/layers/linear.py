"""Linear projections and how tensor parallelism shards them.

Column-parallel projections (q/k/v, gate/up) hold a slice of output rows; row-parallel ones
(o_proj, down_proj) hold a slice of input columns and all-reduce their partial sums. Each
sharded Linear carries its `Shard`, so the loader slices checkpoint tensors without knowing the
model family. Parameters are allocated uninitialised: the loader fills every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.config import ParallelConfig
from kvpipe.model.cpu.packed_linear import can_pack, pack_weight, packed_linear
from kvpipe.model.cpu.panel_weight import Bf16PanelWeight, PanelWeight, bf16_panels, panel_kernels
from kvpipe.model.quant.weights import QuantizedWeight


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint weight [out, in] one TP rank holds: [start, start + length) along
    dim 0 (column-parallel: output rows; a bias is sliced alike) or dim 1 (row-parallel: input
    columns; a bias stays whole). Other modules' parameters (`param_shards`, e.g. GPT-OSS's fused
    experts [E, hidden, 2 I]) may name any dim."""

    dim: int
    start: int
    length: int
    # further (start, length) ranges along `dim`, concatenated after the first: a fused projection
    # whose parts (q, k, v of a gated delta-net) each split by heads
    more: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.length), *self.more)

    @classmethod
    def rows(cls, parallel: ParallelConfig, start: int, length: int) -> Shard | None:
        return cls(0, start, length) if parallel.tp_size > 1 else None

    @classmethod
    def cols(cls, parallel: ParallelConfig, start: int, length: int) -> Shard | None:
        return cls(1, start, length) if parallel.tp_size > 1 else None


class Linear(nn.Module):
    """y = x W^T (+ b), weights [out, in] as in HF checkpoints; allocated empty."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        all_reduce: bool = False,
        group: dist.ProcessGroup | None = None,
        shard: Shard | None = None,
        packable: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.packable = packable  # False: other code reads the dense weight (MLA's absorbed kv_b_proj)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.all_reduce = all_reduce  # row-parallel: sum partial products across the TP group
        self.group = group
        self.shard = shard  # None: the whole checkpoint tensor
        self.quant: QuantizedWeight | None = None  # --quantization: set by quantize(), replaces the weight
        # fp32 or bf16 on the CPU: set by pack(), replaces the weight
        self.panel: PanelWeight | Bf16PanelWeight | None = None

    def pack(self) -> bool:
        """Once loaded: swap the dense fp32 or bf16 weight for its column panels (panel_weight.py;
        the dense one is dropped, an empty [0, in] tensor stays in its place), or oneDNN's packed form
        (packed_linear.py) where the panel kernel is not built; a quantized weight lays its codes
        out in panels (quantized_weight.py). False where nothing was packed (not on the CPU, not
        fp32 or bf16, MLA's kv_b_proj, no panel kernel for quantized codes)."""
        if self.quant is not None:  # int8 / int4 codes in panels too, where the kernels build
            ext = panel_kernels() if self.packable and self.quant.scale.device.type == "cpu" else None
            if ext is not None:
                self.quant.pack(int(ext.f32_panel_width()))
            return ext is not None
        bf16 = bf16_panels(self.weight) if self.packable else None
        if bf16 is not None:
            self.panel = bf16
            self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)
            return True
        if not (self.packable and can_pack(self.weight)):
            return False
        ext = panel_kernels()
        if ext is not None:
            self.panel = PanelWeight.pack(self.weight, ext)
            self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)
        else:
            self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True

    @property
    def form(self) -> str:
        """How the weight is held: "quantized" (--quantization), "panel", "onednn" (packed) or "dense"."""
        if self.quant is not None:
            return "quantized"
        return "panel" if self.panel is not None else "onednn" if self.weight.is_mkldnn else "dense"

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight of an unquantized Linear, whatever form holds it (a copy of a packed one)."""
        if self.quant is not None:
            raise ValueError("a quantized weight has no dense form here")
        if self.panel is not None:
            return self.panel.dense()
        return self.weight.to_dense() if self.weight.is_mkldnn else self.weight

    def quantize(self, weight: QuantizedWeight) -> None:
        """Swap the loaded dense weight for its weight-only quantized form (quantized_weight.py,
        --quantization); the dense one is dropped (an empty [0, in] tensor stays in its place)."""
        self.quant = weight
        self.weight = nn.Parameter(self.weight.new_empty(0, self.weight.shape[1]), requires_grad=False)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)
            return y if bias is None else y + bias
        if self.panel is not None:
            y = self.panel(x)
            return y if bias is None else y + bias
        if self.weight.is_mkldnn:
            return packed_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.all_reduce:
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        dist.all_reduce(y, group=self.group)
        # the bias is replicated: add it once, after the reduction
        return y if self.bias is None else y + self.bias
