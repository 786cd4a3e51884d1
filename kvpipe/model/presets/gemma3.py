"""Built-in Gemma 3 presets: deterministic random weights as a real HF Gemma3ForCausalLM checkpoint
(the config keys and tensor names save_pretrained writes), loadable by transformers. Kept apart
from llama.PresetSpec so the other presets' files stay byte-identical."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpipe.model.families.gemma3 import GEMMA3
from kvpipe.model.presets.scale import WEIGHT_GAIN


@dataclass(frozen=True)
class Gemma3PresetSpec:
    num_layers: int  # Gemma 3's pattern: five sliding layers, then a full one
    sliding_window: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    query_pre_attn_scalar: int  # the attention scale's square; not head_dim, so a wrong scale shows
    max_position_embeddings: int = 8192
    rope_theta: float = 1_000_000.0  # the full layers'
    rope_linear_factor: float = 8.0  # the full layers' linear RoPE scaling (Gemma 3 4B and up)
    rope_local_base_freq: float = 10_000.0  # the sliding layers'
    weight_gain: float = WEIGHT_GAIN  # a projection's std is weight_gain / sqrt(fan_in)
    # The head is tied: a token's logit is its embedding dotted with the normed last hidden state,
    # which holds the input token's embedding times sqrt(hidden). Embeddings small against what
    # the layers add keep the model from echoing its input token; the final norm's large (1 + w)
    # (as trained Gemmas have) spreads the logits again.
    embed_std: float = 0.02
    norm_std: float = 0.2  # the zero-centred norms' weights: (1 + w) scales around 1
    final_norm_mean: float = 15.0

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(self.num_layers)]


GEMMA3_PRESETS: dict[str, Gemma3PresetSpec] = {
    # window 32: prompts of 100+ tokens slide it; a full layer between sliding ones; KV heads and
    # sizes split over TP 2
    "tiny-gemma3": Gemma3PresetSpec(
        num_layers=7,
        sliding_window=32,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        query_pre_attn_scalar=24,
    ),
}


def hf_config(spec: Gemma3PresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    return {
        **GEMMA3.hf_header(),
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "layer_types": spec.layer_types,
        "sliding_window": spec.sliding_window,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "query_pre_attn_scalar": spec.query_pre_attn_scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": spec.rope_linear_factor, "rope_theta": spec.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_base_freq},
        },
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "dtype": "float32",
        "use_cache": True,
    }


def weights(spec: Gemma3PresetSpec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d

    def rnd(*shape: int, std: float | None = None) -> torch.Tensor:
        """Random [out, in] weights of std weight_gain / sqrt(in), or of `std`."""
        scale = spec.weight_gain / math.sqrt(shape[-1]) if std is None else std
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    def norm(dim: int) -> torch.Tensor:
        return rnd(dim, std=spec.norm_std)

    w = {"model.embed_tokens.weight": rnd(vocab_size, h, std=spec.embed_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w[f"{p}{name}_layernorm.weight"] = norm(h)
        a = p + "self_attn."
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            w[a + name + ".weight"] = rnd(rows, cols)
        w[a + "q_norm.weight"] = norm(d)
        w[a + "k_norm.weight"] = norm(d)
        m = p + "mlp."
        w[m + "gate_proj.weight"] = rnd(inter, h)
        w[m + "up_proj.weight"] = rnd(inter, h)
        w[m + "down_proj.weight"] = rnd(h, inter)
    w["model.norm.weight"] = norm(h) + spec.final_norm_mean
    return w
