"""Llama, Qwen2 and Qwen3 (dense): grouped-query attention and a SwiGLU MLP in every layer.

The three differ only in what ModelConfig reads from their HF configs: q/k/v biases (Qwen2, on by
default), a per-head q/k RMSNorm before RoPE (Qwen3); GQAttention applies both. All three have
GGUF files (llama.cpp permutes Llama's q/k rows), and an EAGLE(-1/2) Llama head drafts for each.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kvpipe.model.checkpoint.gguf.family import LAYER_TENSORS, QK_NORM_TENSORS, QKV_BIAS_TENSORS, GGUFFamily
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.families.family import Family, qk_normed
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.mlp import MLP

# SGLang's EAGLE(-1/2) draft head for these targets (draft/eagle.py reads it as a one-layer Llama)
EAGLE_HEAD_ARCHITECTURE = "LlamaForCausalLMEagle"


class LlamaCausalLM(CausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.cfg, layer, self.parallel, self.group)

    def make_mlp(self, layer: int) -> nn.Module:
        return MLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.parallel, self.group)


def qkv_biased(raw: dict[str, Any]) -> dict[str, Any]:
    """q/k/v projections with a bias unless the config says attention_bias=false (Qwen2)."""
    return {"attention_bias": bool(raw.get("attention_bias", True))}


LLAMA = Family(
    "llama",
    ("LlamaForCausalLM",),
    "llama",
    LlamaCausalLM,
    gguf=GGUFFamily("llama", LAYER_TENSORS | QKV_BIAS_TENSORS, permuted_qk=True),  # Llama may carry q/k/v biases
    eagle_target=True,
)
QWEN2 = Family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    "qwen2",
    LlamaCausalLM,
    config=qkv_biased,
    gguf=GGUFFamily("qwen2", LAYER_TENSORS | QKV_BIAS_TENSORS),
    eagle_target=True,
)
QWEN3 = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    "qwen3",
    LlamaCausalLM,
    config=qk_normed,
    gguf=GGUFFamily("qwen3", LAYER_TENSORS | QK_NORM_TENSORS),
    eagle_target=True,
)
