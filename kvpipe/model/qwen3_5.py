"""Qwen3.5 text models (HF Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): a hybrid stack of gated
delta-net layers (linear attention, per-request recurrent state in a StatePool) and gated
full-attention layers (paged KV pool), same API as llama.CausalLM (embed / forward_layers /
compute_logits) plus the StatePool argument. The MoE variant differs only in its MLP: a
moe.SparseMoE block (softmax top-k, renormalised, plus a sigmoid-gated shared expert) in every layer.

Differences from Llama/Qwen3 besides the token mixer: every RMSNorm (layer norms, final norm,
q/k norms) scales by (1 + weight), in fp32; full attention's q_proj also yields a per-head output
gate (o * sigmoid(gate) before o_proj); RoPE turns only the first head_dim * partial_rotary_factor
dims of q and k. Text-only positions make HF's multimodal RoPE sections (mrope) all equal, so
plain 1-D RoPE is exact here.

KV pool: only full-attention layers keep KV pages. The pool holds one buffer per full-attention
layer (cfg.kv_layers), and layer i's attention writes pool layer `kv_layers.index(i)`; with one
full layer in four (Qwen3.5's pattern) a pool of every layer would waste 3/4 of the KV memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import ParallelConfig
from kvpipe.model.attention import paged_attention
from kvpipe.model.config import LayerType, ModelConfig
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.gated_delta_net import GatedDeltaNet, local_linear_heads
from kvpipe.model.layers import Linear, Shard, make_mlp
from kvpipe.model.llama import LMBase
from kvpipe.model.rope import apply_rope


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), all in fp32, cast back last (HF Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, R] with R <= D: rotate the first R dims, pass the rest."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj rows are [q | gate] per head (2 * head_dim each)."""

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
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        o = paged_attention(q, k, v, self.kv_layer, batch, pool, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * d) * torch.sigmoid(gate))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        h = cfg.hybrid
        assert h is not None
        self.layer_type = h.layer_types[layer]
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, h.linear_layers.index(layer), parallel, group)
        else:
            self.self_attn = GatedAttention(cfg, cfg.kv_layers.index(layer), parallel, group)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer, parallel, group)  # dense, or Qwen3.5-MoE's sparse block

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool, state: StatePool
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            h = self.linear_attn(h, batch, state)
        else:
            h = self.self_attn(h, cos, sin, batch, pool)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5CausalLM(LMBase):
    def __init__(
        self, cfg: ModelConfig, parallel: ParallelConfig = ParallelConfig(), group: dist.ProcessGroup | None = None
    ) -> None:
        if cfg.hybrid is None:
            raise ValueError("Qwen3_5CausalLM needs a ModelConfig with a HybridConfig")
        super().__init__(cfg, parallel, group)
        local_linear_heads(cfg.hybrid, parallel)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, parallel, group) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_layers(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        start: int,
        end: int,
        state: StatePool | None = None,
    ) -> torch.Tensor:
        """Run layers [start, end): full-attention layers write their K/V into `pool`, linear ones
        read and write the rows' slots of `state`."""
        self.check_layers(start, end)
        if state is None and any(self.layers[i].layer_type is LayerType.LINEAR_ATTENTION for i in range(start, end)):
            raise ValueError("linear-attention layers need a StatePool")
        cos, sin = self.rope(batch, hidden)  # [T, rotary_dim] each
        for i in range(start, end):
            hidden = self.layers[i](hidden, cos, sin, batch, pool, state)
        return hidden

    def forward(self, batch: ForwardBatch, pool: KVPool, state: StatePool | None = None) -> torch.Tensor:
        hidden = self.forward_layers(self.embed(batch), batch, pool, 0, self.cfg.num_layers, state)
        return self.compute_logits(hidden, batch)
