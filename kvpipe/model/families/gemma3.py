"""Gemma 3 (text): grouped-query attention with sliding-window and global layers, as in HF
transformers' modeling_gemma3.py.

- Layers: `layer_types`, or where a config has none the pattern of `sliding_window_pattern`
  (default 6): five sliding layers, then one global, repeated. A sliding layer sees its last
  `sliding_window` keys (the query's own included), exactly as GPT-OSS's do, so the engine, the
  caches and PD keep and move only its window's pages the same way.
- RoPE: global layers use rope_theta with rope_scaling (linear on the larger models), sliding
  layers rope_local_base_freq (10,000) unscaled: two cos/sin tables per forward
  (ModelConfig.sliding_rope_theta).
- Every norm is the zero-centred RMSNorm (x * (1 + weight), in fp32, cast back last): four per
  layer (input, post-attention, pre-feedforward, post-feedforward: the attention and MLP outputs
  are normed before they join the residual), the final norm and the per-head q/k norms.
- The embedding is scaled by sqrt(hidden), the scalar rounded to the weights' dtype first (HF:
  in bf16 sqrt(640) is 25.25, not 25.298); the head is tied to it.
- Attention scale query_pre_attn_scalar ** -0.5; no sinks, no attention logit softcapping (refused
  when a config asks for it); final logit softcapping where the config has it (Gemma 3's is null).
- MLP: GeGLU, gelu_pytorch_tanh (HF reads `hidden_activation`; `hidden_act` is ignored).

GGUF: llama.cpp's gemma3 files store each norm as 1 + weight (GGUFFamily.norm_shift), a
SentencePiece vocabulary without merges (GGUFFamily.token_order_merges), the window under
`gemma3.attention.sliding_window`, and no local RoPE base or pattern (llama.cpp hard-codes 10,000
and 6, as the defaults here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.family import LAYER_TENSORS, QK_NORM_TENSORS, GGUFFamily
from kvpipe.model.checkpoint.schema import ModelConfig, layer_types
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.families.family import Family
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.mlp import MLP
from kvpipe.model.layers.norms import ZeroCenteredRMSNorm
from kvpipe.model.layers.rope import rope_cos_sin, rope_inv_freq

GELU_TANH = "gelu_pytorch_tanh"
SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3DecoderLayer(nn.Module):
    """h = x + post_attention_norm(attn(input_norm(x))); h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()

        def norm() -> ZeroCenteredRMSNorm:
            return ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, batch, pool))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3CausalLM(CausalLM):
    def make_layer(self, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(self.cfg, self.make_attention(layer), self.make_mlp(layer))

    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.cfg, layer, self.parallel, self.group, head_norm=ZeroCenteredRMSNorm)

    def make_mlp(self, layer: int) -> nn.Module:
        return MLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.parallel, self.group, activation=GELU_TANH)

    def make_norm(self, dim: int) -> nn.Module:
        return ZeroCenteredRMSNorm(dim, self.cfg.rms_norm_eps)

    def init_rope(self, device: str | torch.device | None = None) -> None:
        """The global layers' tables (LMBase's: rope_theta, rope_scaling) and the sliding layers'
        inverse frequencies (rope_local_base_freq, unscaled), fp32."""
        super().init_rope(device)
        theta = self.cfg.sliding_rope_theta
        local = rope_inv_freq(self.cfg.rope_dim, self.cfg.rope_theta if theta is None else theta)
        self.sliding_inv_freq = local if device is None else local.to(device)

    def forward_layers(
        self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool, start: int, end: int
    ) -> torch.Tensor:
        """Layers [start, end), each with the cos/sin of its kind."""
        self.check_layers(start, end)
        full = self.rope(batch, hidden)
        if self.sliding_inv_freq.device != hidden.device:
            self.sliding_inv_freq = self.sliding_inv_freq.to(hidden.device)
        sliding = rope_cos_sin(self.sliding_inv_freq, batch.positions, hidden.dtype)
        for i in range(start, end):
            cos, sin = sliding if self.cfg.window(i) is not None else full
            hidden = self.layers[i](hidden, cos, sin, batch, pool)
        return hidden

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] -> [T, hidden], times sqrt(hidden) rounded to the table's dtype (as HF)."""
        table = self.embed_tokens
        scale = torch.tensor(self.cfg.hidden_size**0.5).to(device=table.device, dtype=table.dtype)  # fp32, then cast
        return F.embedding(batch.input_ids, table) * scale

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = super().compute_logits(hidden, batch)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _rope_parameters(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """transformers >= 5 writes one rope_parameters dict per layer type; older configs a flat one
    (or rope_theta / rope_scaling) for the global layers and rope_local_base_freq."""
    params = raw.get("rope_parameters") or {}
    nested = params.get(kind)
    return dict(nested) if isinstance(nested, dict) else {}


def gemma3_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Sliding and global layers, their two RoPE bases, the attention scale, q/k norms, GeGLU."""
    every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    types = layer_types(raw, (SLIDING, FULL), lambda i: SLIDING if (i + 1) % every else FULL)
    sliding = tuple(i for i, t in enumerate(types) if t == SLIDING)
    window = raw.get("sliding_window")
    if sliding and (window is None or int(window) < 1):
        raise ConfigError(f"sliding_attention layers need a sliding_window >= 1, got {window!r}")
    full, local = _rope_parameters(raw, FULL), _rope_parameters(raw, SLIDING)
    own: dict[str, Any] = {
        "qk_norm": True,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "sliding_window": None if window is None else int(window),
        "sliding_layers": sliding,
        "sliding_rope_theta": float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))),
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "hidden_act": str(raw.get("hidden_activation") or GELU_TANH),
    }
    cap = raw.get("final_logit_softcapping")
    own["final_logit_softcapping"] = None if cap is None else float(cap)
    if full:  # the global layers' base and scaling from their own rope_parameters
        own["rope_theta"] = float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
        kind = full.get("rope_type", "default")
        own["rope_scaling"] = None if kind == "default" else {k: v for k, v in full.items() if k != "rope_theta"}
    elif "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        own["rope_theta"] = 1_000_000.0  # HF's default for the global layers
    return own


def check_gemma3(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Options of Gemma 3's config the model does not implement."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ConfigError("attn_logit_softcapping is not supported (Gemma 3 has none)")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true (an encoder) is not supported")
    local = _rope_parameters(raw, SLIDING)
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"sliding layers' rope_type {local['rope_type']!r} is not supported (only default)")


GEMMA3_TENSORS = {
    **LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # llama's post_attention_layernorm
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **QK_NORM_TENSORS,
}

GEMMA3 = Family(
    "gemma3",
    ("Gemma3ForCausalLM",),
    "gemma3_text",
    Gemma3CausalLM,
    config=gemma3_config,
    check=check_gemma3,
    gguf=GGUFFamily(
        "gemma3",
        GEMMA3_TENSORS,
        config_keys={"attention.sliding_window": "sliding_window"},
        norm_shift=1.0,
        token_order_merges=True,
    ),
    activations=(GELU_TANH,),
)
