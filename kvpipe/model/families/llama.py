"""Llama, Qwen2 and Qwen3 (dense): grouped-query attention and a SwiGLU MLP in every layer.

The three differ only in what ModelConfig reads from their HF configs: q/k/v biases (Qwen2), a
per-head q/k RMSNorm before RoPE (Qwen3); GQAttention applies both.
"""

from __future__ import annotations

from torch import nn

from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.mlp import MLP


class LlamaCausalLM(CausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.cfg, layer, self.parallel, self.group)

    def make_mlp(self, layer: int) -> nn.Module:
        return MLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.parallel, self.group)
