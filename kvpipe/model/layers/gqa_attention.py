"""Grouped-query (or multi-head) attention over the paged KV pool, tensor-parallel by heads.

q/k/v are column-parallel (a rank holds its query heads and the KV heads they read; KV heads
are replicated when tp > KV heads), o_proj is row-parallel with one all-reduce. What differs by
family is read from ModelConfig: q/k/v biases (Qwen2), o_proj's bias, attention sinks and
sliding-window layers (GPT-OSS, Gemma 3), q/k RMSNorm per head (Qwen3; Gemma 3's zero-centred
one: the family's `head_norm`) or over the whole projection (MiniMax-M2), partial rotary
(rope.apply_rope rotates the first rope_dim dims), the softmax scale (Gemma 3's
query_pre_attn_scalar).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.cpu.fused_projections import fuse_linears
from kvpipe.model.cpu.kernels.rope_store import can_rope_store, rope_store_kernel
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.attention import paged_attention
from kvpipe.model.layers.linear import Linear, Shard
from kvpipe.model.layers.norms import RMSNorm, ShardedRMSNorm, whole_qk_norm
from kvpipe.model.layers.rope import apply_rope


class GQAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        parallel: ParallelConfig,
        group: dist.ProcessGroup | None,
        head_norm: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        """head_norm(head_dim, eps): the per-head q/k norm where cfg.qk_norm_per_head."""
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.head_dim
        self.num_heads = parallel.local_heads(cfg.num_heads)
        self.num_kv_heads = parallel.local_kv_heads(cfg.num_kv_heads)
        self.scale = cfg.softmax_scale
        tp = parallel.tp_size > 1
        d, bias = cfg.head_dim, cfg.attention_bias
        q0, kv0 = parallel.tp_rank * self.num_heads * d, parallel.kv_head_start(cfg.num_kv_heads) * d
        q_rows, kv_rows = Shard.rows(parallel, q0, self.num_heads * d), Shard.rows(parallel, kv0, self.num_kv_heads * d)
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * d, bias, shard=q_rows)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, shard=kv_rows)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, shard=kv_rows)
        self.o_proj = Linear(
            self.num_heads * d,
            cfg.hidden_size,
            cfg.o_proj_bias,
            all_reduce=tp,
            group=group,
            shard=Shard.cols(parallel, q0, self.num_heads * d),
        )
        self.group = group
        # GPT-OSS: a sink logit per query head (this rank's heads) and, in sliding layers, a window
        self.window = cfg.window(layer)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if cfg.attention_sinks else None
        self.param_shards = (
            {"sinks": Shard(0, parallel.tp_rank * self.num_heads, self.num_heads)} if cfg.attention_sinks and tp else {}
        )
        # q/k/v as one Linear once loaded (fuse_projections; fused_projections.py), else None
        self.qkv: Linear | None = None
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm and cfg.qk_norm_per_head:
            self.q_norm, self.k_norm = head_norm(d, cfg.rms_norm_eps), head_norm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm:  # over all heads: sliced like q/k; KV heads replicated when tp > KV heads
            self.q_norm = ShardedRMSNorm(cfg.num_heads * d, q_rows, self.num_heads * d, cfg.rms_norm_eps)
            self.k_norm = ShardedRMSNorm(
                cfg.num_kv_heads * d,
                kv_rows,
                self.num_kv_heads * d,
                cfg.rms_norm_eps,
                replicas=max(1, parallel.tp_size // cfg.num_kv_heads),
            )

    def fuse_projections(self) -> bool:
        """Fuse q/k/v into `qkv` (after loading, before packing); False where they stay apart."""
        if self.qkv is None:
            self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None and self.q_norm is None:
            return self._forward_fused(self.qkv(x), cos, sin, batch, pool)
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(self._qkv_sizes(), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_norm, k_norm = self.q_norm, self.k_norm
        whole = isinstance(q_norm, ShardedRMSNorm)
        if isinstance(q_norm, ShardedRMSNorm) and isinstance(k_norm, ShardedRMSNorm):  # MiniMax-M2: over all heads
            q, k = whole_qk_norm(q, k, q_norm, k_norm, self.group)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not whole and q_norm is not None and k_norm is not None:  # Qwen3, Gemma 3: per-head norm before RoPE
            q, k = q_norm(q), k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, self.layer, batch, pool, self.scale, self.sinks, self.window)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def _qkv_sizes(self) -> list[int]:
        d = self.head_dim
        return [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]

    def _forward_fused(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] with no q/k norm: q and k rotated in one pass (elementwise, so
        the same bits as rotating each alone), v a view of qkv."""
        t, hq, hkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        heads = qkv.view(t, hq + 2 * hkv, self.head_dim)
        kernel = None
        if self.window is None and can_rope_store(qkv, cos, pool.k[self.layer], self.head_dim):
            kernel = rope_store_kernel()
        if kernel is not None:  # rotated and stored in one call: the same bits (rope_store.cpp)
            k_pool, v_pool = pool.k[self.layer], pool.v[self.layer]
            qk = kernel.rope_store(qkv, cos, sin, k_pool, v_pool, batch.slot_pages, batch.slot_offsets, hq, hkv)
        else:
            qk = apply_rope(heads[:, : hq + hkv], cos, sin)  # [T, Hq + Hkv, D]
        o = paged_attention(
            qk[:, :hq],
            qk[:, hq:],
            heads[:, hq + hkv :],
            self.layer,
            batch,
            pool,
            self.scale,
            self.sinks,
            self.window,
            stored=kernel is not None,
        )  # [T, Hq, D]
        return self.o_proj(o.reshape(t, hq * self.head_dim))
