"""RMSNorms: the plain one (per token, or per head for Qwen3's q/k norms), the zero-centred one
of Qwen3.5 and Gemma 3, and the norm over a whole q or k projection (MiniMax-M2), tensor-parallel.

The whole-projection norm: under TP each rank holds a slice of the heads, so the vector being
normalised spans ranks. The statistic is a sum, so each rank sums the squares of its slice and
one all-reduce adds them: the same mean square as on one rank, with no gather of the
activations. KV heads replicated over ranks (tp > KV heads) are counted once per replica, so the
reduced sum is divided by that count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.model.layers.linear import Shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # GPT-OSS: an fp32 weight (HF keeps these norms in fp32), applied before casting back
        self.fp32_weight = fp32_weight
        self.keep_fp32 = ("weight",) if fp32_weight else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, weight applied after casting back (HF LlamaRMSNorm order)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            # fp32: torch's rms_norm computes the same ops in the same order (the same bits,
            # tests/unit/test_fused_projections.py) in one call instead of six, and a decode step
            # runs 2 per layer (docs/benchmarks.md, issue 31). Not bf16/fp16: there it applies
            # the weight before rounding back, HF after.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        if x.device.type == "cpu":  # the same fp32 ops in one call (above), the weight applied after
            h = F.rms_norm(h, self.weight.shape, None, self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), all in fp32, cast back last (HF Qwen3_5RMSNorm, Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class ShardedRMSNorm(nn.Module):
    """The weight slice [start, start + length) of an RMSNorm over `full_dim` features; `normalize`
    takes the global sum of squares, computed by the caller (see `whole_qk_norm`)."""

    def __init__(self, full_dim: int, shard: Shard | None, length: int, eps: float, replicas: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(length), requires_grad=False)
        self.shard = shard  # the loader slices the checkpoint's [full_dim] weight with it
        self.full_dim = full_dim
        self.eps = eps
        self.replicas = replicas  # ranks holding the same slice: each adds its squares once

    def normalize(self, x: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
        """x: [T, length]; sum_sq: [T, 1] fp32 over all ranks -> [T, length] (HF MiniMaxM2RMSNorm order)."""
        dtype = x.dtype
        h = x.to(torch.float32) * torch.rsqrt(sum_sq / (self.full_dim * self.replicas) + self.eps)
        return self.weight * h.to(dtype)


def whole_qk_norm(
    q: torch.Tensor, k: torch.Tensor, q_norm: ShardedRMSNorm, k_norm: ShardedRMSNorm, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq_local * D], k: [T, Hkv_local * D] -> both normalised; one all-reduce for both."""
    sum_sq = torch.cat(
        [q.to(torch.float32).pow(2).sum(-1, keepdim=True), k.to(torch.float32).pow(2).sum(-1, keepdim=True)], dim=-1
    )  # [T, 2]
    if q_norm.shard is not None:  # q is sliced over TP ranks (tp > 1)
        dist.all_reduce(sum_sq, group=group)
    return q_norm.normalize(q, sum_sq[:, :1]), k_norm.normalize(k, sum_sq[:, 1:])
