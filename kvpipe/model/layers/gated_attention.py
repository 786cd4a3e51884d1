"""Qwen3.5's full attention: grouped-query attention over the paged KV pool with a per-head
output gate (o * sigmoid(gate) before o_proj; q_proj rows are [q | gate] per head), zero-centred
q/k RMSNorms per head and partial rotary. Tensor-parallel by heads like gqa_attention.py.

It writes KV pool layer `kv_layer`: in a hybrid stack only the full-attention layers keep KV
pages, so the pool holds one buffer per full-attention layer (ModelConfig.kv_layers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.attention import paged_attention
from kvpipe.model.layers.linear import Linear, Shard
from kvpipe.model.layers.norms import ZeroCenteredRMSNorm
from kvpipe.model.layers.rope import apply_rope


class GatedAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, kv_layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.kv_layer = kv_layer  # this layer's buffer in the KV pool
        d = self.head_dim = cfg.head_dim
        self.num_heads = parallel.local_heads(cfg.num_heads)
        self.num_kv_heads = parallel.local_kv_heads(cfg.num_kv_heads)
        self.scale = d**-0.5
        h0, kv0 = parallel.tp_rank * self.num_heads, parallel.kv_head_start(cfg.num_kv_heads)
        bias, kv_rows = cfg.attention_bias, Shard.rows(parallel, kv0 * d, self.num_kv_heads * d)
        self.q_proj = Linear(
            cfg.hidden_size,
            self.num_heads * 2 * d,
            bias,
            shard=Shard.rows(parallel, h0 * 2 * d, self.num_heads * 2 * d),
        )
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, shard=kv_rows)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, shard=kv_rows)
        self.o_proj = Linear(
            self.num_heads * d,
            cfg.hidden_size,
            bias,
            all_reduce=parallel.tp_size > 1,
            group=group,
            shard=Shard.cols(parallel, h0 * d, self.num_heads * d),
        )
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg = self.q_proj(x).view(t, self.num_heads, 2 * d)
        q, gate = self.q_norm(qg[..., :d]), qg[..., d:].reshape(t, self.num_heads * d)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # the first rotary_dim dims of each head
        o = paged_attention(q, k, v, self.kv_layer, batch, pool, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * d) * torch.sigmoid(gate))
