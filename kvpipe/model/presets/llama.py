"""The Llama-shaped presets, one PresetSpec each: dense Llama (`tiny`, `tiny-kv4`, `bench`), and
with a MoEPresetSpec the sparse families written with their hub checkpoints' config keys and
tensor names (`tiny-qwen3-moe`, `tiny-minimax-m2`; `tiny-deepseek-v3` adds MLA, deepseek.py).

`tiny` makes tests run in seconds; `bench` has a realistic KV-bytes-to-compute ratio for the
transfer benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpipe.config import ConfigError
from kvpipe.model.families.deepseek_v3 import DEEPSEEK_V3
from kvpipe.model.families.llama import LLAMA
from kvpipe.model.families.minimax_m2 import MINIMAX_M2
from kvpipe.model.families.qwen3_moe import QWEN3_MOE
from kvpipe.model.presets.deepseek import MLAPresetSpec, deepseek_v3_config, mla_attention_weights, mtp_layer_weights
from kvpipe.model.presets.scale import WEIGHT_GAIN


@dataclass(frozen=True)
class MoEPresetSpec:
    """The sparse part of an MoE preset; its family decides the HF config and tensor names."""

    family: str  # Family.name: Qwen3-MoE, MiniMax-M2 or DeepSeek-V3
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # a dense MLP of intermediate_size: Qwen3-MoE mlp_only_layers, DeepSeek-V3 the first_k_dense_replace first
    dense_layers: tuple[int, ...] = ()
    rotary_dim: int | None = None  # MiniMax-M2 partial rotary: the rotated dims of each head
    bias_std: float = 0.05  # MiniMax-M2 / DeepSeek-V3 e_score_correction_bias: nonzero, so it steers the routing
    # DeepSeek-V3: group-limited routing, shared experts (of expert_intermediate_size each), weight scale
    num_groups: int = 1
    topk_groups: int = 1
    shared_experts: int = 0
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class PresetSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # untied: a tied random model mostly echoes its input token
    weight_gain: float = WEIGHT_GAIN  # a projection's std is weight_gain / sqrt(fan_in)
    embed_std: float = 1.0
    moe: MoEPresetSpec | None = None  # None: a dense Llama
    mla: MLAPresetSpec | None = None  # latent attention (DeepSeek-V3); num_kv_heads is then unused

    @property
    def family(self) -> str:
        return LLAMA.name if self.moe is None else self.moe.family


PRESETS: dict[str, PresetSpec] = {
    "tiny": PresetSpec(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256),
    # tiny with one KV head per query head: every TP pairing up to 4 slices heads (staging tests)
    "tiny-kv4": PresetSpec(
        num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=256
    ),
    # GPT-2-small-sized stack with mild GQA (3 query heads per KV head), fp32.
    "bench": PresetSpec(
        num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048
    ),
    # MoE presets: 8 experts, top-2; every size splits over TP 4
    "tiny-qwen3-moe": PresetSpec(
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe=MoEPresetSpec(QWEN3_MOE.name, num_experts=8, top_k=2, expert_intermediate_size=64, dense_layers=(0,)),
    ),
    "tiny-minimax-m2": PresetSpec(
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=64,
        moe=MoEPresetSpec(MINIMAX_M2.name, num_experts=8, top_k=2, expert_intermediate_size=64, rotary_dim=16),
    ),
    # MLA (latent 32 + rope 16 per token and layer, q LoRA 64, yarn x4) + MoE (layer 0 dense, then
    # 8 experts in 2 groups, top-2 from the best group, 1 shared expert); every size splits over TP 4;
    # one multi-token-prediction layer (layer 4, sparse) for the NEXTN drafter
    "tiny-deepseek-v3": PresetSpec(
        num_layers=4,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=8,
        head_dim=16,
        intermediate_size=256,
        moe=MoEPresetSpec(
            DEEPSEEK_V3.name,
            num_experts=8,
            top_k=2,
            expert_intermediate_size=64,
            dense_layers=(0,),
            num_groups=2,
            topk_groups=1,
            shared_experts=1,
            routed_scaling_factor=2.5,
        ),
        mla=MLAPresetSpec(
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            yarn_factor=4.0,
            nextn_layers=1,
        ),
    ),
}


def hf_config(spec: PresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    cfg = {
        **LLAMA.hf_header(),
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    moe = spec.moe
    if moe is None:
        return cfg
    for key in ("rope_scaling", "mlp_bias"):  # not options of the MoE families' HF configs
        del cfg[key]
    if moe.family == QWEN3_MOE.name:
        return (
            cfg
            | QWEN3_MOE.hf_header()
            | {
                "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.expert_intermediate_size,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(moe.dense_layers),
                "use_sliding_window": False,
            }
        )
    if moe.family == MINIMAX_M2.name:
        if spec.intermediate_size != moe.expert_intermediate_size or moe.dense_layers:
            raise ConfigError("MiniMax-M2 has no dense layers: intermediate_size is the expert size")
        return (
            cfg
            | MINIMAX_M2.hf_header()
            | {
                "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "rotary_dim": moe.rotary_dim or spec.head_dim,
                "scoring_func": "sigmoid",
                "use_routing_bias": True,
                "use_qk_norm": True,
                "qk_norm_type": "per_layer",
            }
        )
    if moe.family == DEEPSEEK_V3.name and spec.mla is not None:
        return cfg | deepseek_v3_config(spec.num_layers, spec.num_heads, spec.head_dim, spec.mla, moe)
    raise ConfigError(f"unknown MoE preset family {moe.family!r}")


def weights(spec: PresetSpec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def rnd(*shape: int, std: float | None = None) -> torch.Tensor:
        """Random [out, in] weights of std weight_gain / sqrt(in), or of `std`."""
        scale = spec.weight_gain / math.sqrt(shape[-1]) if std is None else std
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    w = {"model.embed_tokens.weight": rnd(vocab_size, h, std=spec.embed_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if spec.mla is not None:
            w.update(mla_attention_weights(h, spec.num_heads, spec.mla, i, rnd))
        else:
            w[p + "self_attn.q_proj.weight"] = rnd(spec.num_heads * d, h)
            w[p + "self_attn.k_proj.weight"] = rnd(spec.num_kv_heads * d, h)
            w[p + "self_attn.v_proj.weight"] = rnd(spec.num_kv_heads * d, h)
            w[p + "self_attn.o_proj.weight"] = rnd(h, spec.num_heads * d)
        if spec.moe is None:
            w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
            w[p + "mlp.up_proj.weight"] = rnd(inter, h)
            w[p + "mlp.down_proj.weight"] = rnd(h, inter)
        else:
            w.update(_moe_layer_weights(spec, spec.moe, i, rnd))
    w["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = rnd(vocab_size, h)
    if spec.mla is not None and spec.moe is not None:  # DeepSeek-V3's MTP layers, drawn after the rest
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        for i in range(spec.num_layers, spec.num_layers + spec.mla.nextn_layers):
            p = f"model.layers.{i}."
            w[p + "input_layernorm.weight"] = torch.ones(h)
            w[p + "post_attention_layernorm.weight"] = torch.ones(h)
            w.update(mla_attention_weights(h, spec.num_heads, spec.mla, i, rnd))
            w.update(_moe_layer_weights(spec, spec.moe, i, rnd))
            w.update(mtp_layer_weights(h, i, w["model.embed_tokens.weight"], head, rnd))
    return w


def _moe_layer_weights(
    spec: PresetSpec, moe: MoEPresetSpec, layer: int, rnd: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Layer `layer`'s q/k norms (none for DeepSeek-V3's MLA) and MLP (dense or sparse) under the
    family's hub tensor names."""
    h, d, p = spec.hidden_size, spec.head_dim, f"model.layers.{layer}."
    per_head = moe.family == QWEN3_MOE.name  # MiniMax-M2 norms the whole q / k projection
    mixtral_names = moe.family == MINIMAX_M2.name
    w = (
        {}
        if moe.family == DEEPSEEK_V3.name
        else {
            p + "self_attn.q_norm.weight": torch.ones(d if per_head else spec.num_heads * d),
            p + "self_attn.k_norm.weight": torch.ones(d if per_head else spec.num_kv_heads * d),
        }
    )
    if layer in moe.dense_layers:
        inter = spec.intermediate_size
        return w | {
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
        }
    inter = moe.expert_intermediate_size
    # (gate, up, down) names per family: Qwen3-MoE's and DeepSeek-V3's mirror the dense MLP,
    # MiniMax-M2's are Mixtral's
    block, names = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral_names else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    w[p + f"{block}.gate.weight"] = rnd(moe.num_experts, h)
    if moe.family == MINIMAX_M2.name:
        w[p + f"{block}.e_score_correction_bias"] = rnd(moe.num_experts, std=moe.bias_std)
    if moe.family == DEEPSEEK_V3.name:
        w[p + "mlp.gate.e_score_correction_bias"] = rnd(moe.num_experts, std=moe.bias_std)
    for e in range(moe.num_experts):
        q = p + f"{block}.experts.{e}."
        w[q + f"{names[0]}.weight"] = rnd(inter, h)
        w[q + f"{names[1]}.weight"] = rnd(inter, h)
        w[q + f"{names[2]}.weight"] = rnd(h, inter)
    if moe.shared_experts:  # DeepSeek-V3: one fused shared MLP of shared_experts * expert size
        shared = moe.shared_experts * inter
        q = p + "mlp.shared_experts."
        w[q + "gate_proj.weight"], w[q + "up_proj.weight"] = rnd(shared, h), rnd(shared, h)
        w[q + "down_proj.weight"] = rnd(h, shared)
    return w
