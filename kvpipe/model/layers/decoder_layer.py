"""The pre-norm decoder layer of every family but the hybrid one: x + attn(norm(x)), then
h + mlp(norm(h)). The family builds the four parts (causal_lm.CausalLM.make_layer); the
attribute names are HF's, so the checkpoint names follow from the module tree."""

from __future__ import annotations

import torch
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.model.forward_batch import ForwardBatch


class DecoderLayer(nn.Module):
    def __init__(
        self, input_layernorm: nn.Module, self_attn: nn.Module, post_attention_layernorm: nn.Module, mlp: nn.Module
    ) -> None:
        """self_attn: (x, cos, sin, batch, pool) -> [T, hidden], writing its K/V into the pool
        (gqa_attention.GQAttention, mla.MLAttention); mlp: [T, hidden] -> [T, hidden]."""
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return h + self.mlp(self.post_attention_layernorm(h))
