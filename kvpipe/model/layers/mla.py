"""Multi-head latent attention (DeepSeek-V2/V3) over a latent paged KV cache, tensor-parallel aware.

Per token and layer the cache holds one latent row of kv_lora_rank + qk_rope_head_dim numbers:
the normalised compressed KV c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]), then the
already ROTATED shared key k_rope. kv_b_proj recovers the heads from c: per head h,
k_nope_h = W_uk_h c and v_h = W_uv_h c (W_uk_h [nope, C], W_uv_h [v, C], C = kv_lora_rank).

The same attention in two forms, picked by the work shape:
- prefill, EXPANDED: k_nope and v of every key are materialised through kv_b_proj and SDPA runs
  on [heads, keys, qk_head_dim] exactly as attention.py does. A prefill is compute-bound (E
  queries x L keys), the expansion is paid once per key for all E queries, and it is HF's own
  formulation, so logits stay closest to HF.
- decode, ABSORBED: W_uk folds into the query (q_lat_h = W_uk_h^T q_nope_h, [C]) and W_uv into
  the output (o_h = W_uv_h (sum_j p_j c_j)), so scores and the weighted sum run on the cached
  latent rows in place. A decode step is memory-bound: it reads C + rope numbers per key, once for
  all heads (MQA-like: one latent "KV head", H query heads), instead of H * (qk_head_dim + v)
  expanded numbers per key.
Work shapes as attention.py: whole-prompt prefill (causal SDPA on the new tokens, no gather), a
prefill behind a cached prefix (a later chunk, a prefix-cache hit: gather the row's latent pages,
expand, lower-right causal mask), batched decode (one pass over the batch's pages, DecodeIndex).

TP: query heads split over ranks; q_b_proj (or q_proj) and kv_b_proj column-parallel by heads,
o_proj row-parallel with an all-reduce. q_a_proj, kv_a_proj_with_mqa and their norms are
replicated, so every rank computes and caches the same latent (ModelConfig.kv_cache_heads == 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.cpu.kernels import paged_decode_kernel
from kvpipe.model.forward_batch import DecodeIndex, ForwardBatch
from kvpipe.model.layers.attention import attend_pages, causal_attention, prefix_attention
from kvpipe.model.layers.linear import Linear, Shard
from kvpipe.model.layers.norms import RMSNorm
from kvpipe.model.layers.rope import apply_rope, apply_rope_interleaved, rope_type, yarn_get_mscale

# HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when the config scales RoPE
    (HF's DeepSeek `yarn_apply_mscale`: the softmax temperature of the extended context)."""
    scale = qk_head_dim ** (-0.5)
    if rope_type(scaling) != "default" and scaling:
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_get_mscale(scaling["factor"], mscale_all_dim)
            scale = scale * mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "MLAttention needs ModelConfig.mla"
        self.layer = layer
        self.num_heads = h = parallel.local_heads(cfg.num_heads)
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim = mla.qk_head_dim
        self.rotate = apply_rope_interleaved if mla.rope_interleave else apply_rope
        self.scale = mla_softmax_scale(mla.qk_head_dim, cfg.rope_scaling)
        hidden, bias, qk = cfg.hidden_size, cfg.attention_bias, mla.qk_head_dim
        kvb = mla.qk_nope_head_dim + mla.v_head_dim  # kv_b_proj rows per head: [k_nope | v]
        h0 = parallel.tp_rank * h  # first global head of this rank
        q_rows = Shard.rows(parallel, h0 * qk, h * qk)
        if mla.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, h * qk, shard=q_rows)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, h * qk, shard=q_rows)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, h * kvb, shard=Shard.rows(parallel, h0 * kvb, h * kvb), packable=False
        )  # decode reads its heads' blocks (absorbed form)
        self.o_proj = Linear(
            h * mla.v_head_dim,
            hidden,
            bias,
            all_reduce=parallel.tp_size > 1,
            group=group,
            shard=Shard.cols(parallel, h0 * mla.v_head_dim, h * mla.v_head_dim),
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        """x [T, hidden]; cos, sin [T, rope_dim]. Writes the T latent rows, returns [T, hidden]."""
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:  # low-rank q: the three are set together
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope = self.rotate(q_rope, cos, sin)  # [T, H, rope]
        k_rope = self.rotate(k_rope[:, None], cos, sin)  # [T, 1, rope]: one key shared by every head
        latent = torch.cat([self.kv_a_layernorm(c)[:, None], k_rope], dim=-1)  # [T, 1, C + rope]
        pool.write(self.layer, batch.slot_pages, batch.slot_offsets, latent)
        if batch.kv_stored is not None:
            batch.kv_stored(self.layer)
        if batch.decode is not None:
            o = self._decode(q_nope, q_rope, batch.decode, pool)
        else:
            o = self._prefill(torch.cat([q_nope, q_rope], dim=-1), latent[:, 0], batch, pool)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, C + rope] -> per-head keys [L, H, qk_dim] and values [L, H, v_dim]."""
        n = latent.shape[0]
        c, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(n, self.num_heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(n, self.num_heads, self.rope_dim)], dim=-1)
        return k, v

    def _prefill(self, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Expanded form. q [T, H, qk_dim]; latent [T, C + rope] of the new tokens -> [T, H, v_dim]."""
        if len(batch.seqs) == 1 and batch.seqs[0].prefix_len == 0:  # the common whole-prompt prefill
            return causal_attention(q, *self._expand(latent), self.scale)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        for s in batch.seqs:
            rows = slice(s.start, s.start + s.extend_len)
            if s.prefix_len == 0:
                out[rows] = causal_attention(q[rows], *self._expand(latent[rows]), self.scale)
            else:
                ctx, _ = pool.gather(self.layer, s.page_table, s.total_len)  # [1, L, C + rope], new tokens included
                k, v = self._expand(ctx[0])
                out[rows] = prefix_attention(q[rows], k.transpose(0, 1), v.transpose(0, 1), s.prefix_len, self.scale)
        return out

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, index: DecodeIndex, pool: KVPool) -> torch.Tensor:
        """Absorbed form over the latent pages. q_nope [B, H, nope], q_rope [B, H, rope] -> [B, H, v_dim]."""
        b, n, c = index.batch_size, index.num_pages, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, c)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, C], [H, v, C]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
        q = torch.cat([q_lat, q_rope], dim=-1)  # [B, H, C + rope], against latent rows [c | k_rope]
        kernel = paged_decode_kernel() if q.device.type == "cpu" else None
        latent = pool.k[self.layer]  # [N, 1, P, C + rope]
        s = pool.k_scale[self.layer]  # the latent's one scale (an fp8 pool), for keys and values alike
        if kernel is not None:  # the latent pages in place; values are their prefix view [..., :C]
            o_lat = kernel(
                q,
                latent,
                latent[..., :c],
                index.page_table,
                index.lens,
                index.key_start,
                self.scale,
                k_scale=s,
                v_scale=s,
            )
        else:
            pages = pool.read_pages(self.layer, index.pages).view(b, n, 1, pool.page_size, pool.head_dim)
            o_lat = attend_pages(q, pages, pages[..., :c], index.valid, self.scale)  # [B, H, C]: values are c itself
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]
