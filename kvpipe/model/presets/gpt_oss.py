"""Built-in GPT-OSS presets: deterministic random weights as a real HF GptOssForCausalLM
checkpoint (the tensor names and fused expert layout save_pretrained writes), loadable by
transformers. Kept apart from llama.PresetSpec so the other presets' files stay byte-identical."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpipe.model.families.gpt_oss import GPT_OSS
from kvpipe.model.presets.scale import WEIGHT_GAIN


@dataclass(frozen=True)
class GptOssPresetSpec:
    num_layers: int  # alternating sliding / full attention, sliding first (HF's default pattern)
    sliding_window: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    max_position_embeddings: int = 8192
    rope_theta: float = 150000.0
    yarn_factor: float = 2.0  # GPT-OSS ships yarn with truncate=false
    yarn_original_max_position_embeddings: int = 4096
    weight_gain: float = WEIGHT_GAIN  # a projection's std is weight_gain / sqrt(fan_in)
    embed_std: float = 1.0
    bias_std: float = 0.02
    sink_std: float = 1.0  # sinks of a few units: they take a visible share of each softmax

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_layers)]


GPT_OSS_PRESETS: dict[str, GptOssPresetSpec] = {
    # window 32: prompts of 100+ tokens slide it; heads, KV heads and expert sizes split over TP 4
    "tiny-gpt-oss": GptOssPresetSpec(
        num_layers=4,
        sliding_window=32,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        num_experts=8,
        top_k=2,
        expert_intermediate_size=64,
    ),
}


def hf_config(spec: GptOssPresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    return {
        **GPT_OSS.hf_header(),
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.expert_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "layer_types": spec.layer_types,
        "sliding_window": spec.sliding_window,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": spec.rope_theta,
            "factor": spec.yarn_factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": spec.yarn_original_max_position_embeddings,
        },
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "float32",
        "use_cache": True,
    }


def weights(spec: GptOssPresetSpec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, e, inter = spec.hidden_size, spec.head_dim, spec.num_experts, spec.expert_intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d

    def rnd(*shape: int, std: float | None = None) -> torch.Tensor:
        """Random [out, in] weights of std weight_gain / sqrt(in), or of `std`."""
        scale = spec.weight_gain / math.sqrt(shape[-1]) if std is None else std
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    w = {"model.embed_tokens.weight": rnd(vocab_size, h, std=spec.embed_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        a = p + "self_attn."
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            w[a + name + ".weight"] = rnd(rows, cols)
            w[a + name + ".bias"] = rnd(rows, std=spec.bias_std)
        w[a + "sinks"] = rnd(spec.num_heads, std=spec.sink_std)
        m = p + "mlp."
        w[m + "router.weight"] = rnd(e, h)
        w[m + "router.bias"] = rnd(e, std=spec.bias_std)
        # fused experts, x @ W layout ([experts, in, out]); gate/up interleaved along the last dim
        w[m + "experts.gate_up_proj"] = rnd(e, h, 2 * inter, std=spec.weight_gain / math.sqrt(h))
        w[m + "experts.gate_up_proj_bias"] = rnd(e, 2 * inter, std=spec.bias_std)
        w[m + "experts.down_proj"] = rnd(e, inter, h, std=spec.weight_gain / math.sqrt(inter))
        w[m + "experts.down_proj_bias"] = rnd(e, h, std=spec.bias_std)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = rnd(vocab_size, h)
    return w
