"""Building blocks of a Llama/Qwen decoder layer, tensor-parallel aware.

Column-parallel projections (q/k/v, gate/up) hold a slice of output rows; row-parallel ones
(o_proj, down_proj) hold a slice of input columns and all-reduce their partial sums. Parameters
are allocated uninitialised: the loader fills every one of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ModelConfig, ParallelConfig
from kvpipe.model.attention import paged_attention
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.rope import apply_rope


class Linear(nn.Module):
    """y = x W^T (+ b), weights [out, in] as in HF checkpoints; allocated empty."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 all_reduce: bool = False, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.all_reduce = all_reduce  # row-parallel: sum partial products across the TP group
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.all_reduce:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        # the bias is replicated: add it once, after the reduction
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, weight applied after casting back (HF LlamaRMSNorm order)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.head_dim
        self.num_heads = parallel.local_heads(cfg.num_heads)
        self.num_kv_heads = parallel.local_kv_heads(cfg.num_kv_heads)
        self.scale = cfg.head_dim ** -0.5
        tp = parallel.tp_size > 1
        d, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * d, bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias)
        self.o_proj = Linear(self.num_heads * d, cfg.hidden_size, False, all_reduce=tp, group=group)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, self.layer, batch, pool, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        inter = cfg.intermediate_size // parallel.tp_size
        self.gate_proj = Linear(cfg.hidden_size, inter)
        self.up_proj = Linear(cfg.hidden_size, inter)
        self.down_proj = Linear(inter, cfg.hidden_size, all_reduce=parallel.tp_size > 1, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, parallel, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, parallel, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return h + self.mlp(self.post_attention_layernorm(h))
