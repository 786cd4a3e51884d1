"""The DeepSeek-V3 parts of a preset: multi-head latent attention's sizes, the HF config keys
of the family, and each layer's MLA tensors under the hub checkpoints' names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpipe.config import ConfigError
from kvpipe.model.families.deepseek_v3 import DEEPSEEK_V3


@dataclass(frozen=True)
class MLAPresetSpec:
    """Latent attention sizes (HF DeepseekV3Config names) and the yarn RoPE extension V3 ships with."""

    q_lora_rank: int | None  # None: one full q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    yarn_factor: float | None = None  # None: plain RoPE
    yarn_original_max_position_embeddings: int = 2048
    # multi-token-prediction layers after the decoder stack (HF's num_nextn_predict_layers; the
    # NEXTN drafter, model/draft/mtp.py), written under model.layers.{num_layers + i}.
    nextn_layers: int = 0


def deepseek_v3_config(num_layers: int, num_heads: int, head_dim: int, mla: MLAPresetSpec, moe: Any) -> dict[str, Any]:
    """Config keys of DeepseekV3ForCausalLM over a Llama-style base config. `moe` is the preset's
    MoEPresetSpec: its dense layers must be the first ones (first_k_dense_replace)."""
    k = len(moe.dense_layers)
    if moe.dense_layers != tuple(range(k)):
        raise ConfigError("DeepSeek-V3's dense layers are the first first_k_dense_replace ones")
    if head_dim != mla.qk_rope_head_dim:  # HF's DeepseekV3Config sets head_dim = qk_rope_head_dim
        raise ConfigError("a DeepSeek-V3 preset's head_dim is its qk_rope_head_dim")
    rope_scaling = (
        None
        if mla.yarn_factor is None
        else {
            # DeepSeek-V3's own shape (mscale == mscale_all_dim: cos/sin unscaled, softmax scale mscale^2)
            "type": "yarn",
            "factor": mla.yarn_factor,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": mla.yarn_original_max_position_embeddings,
        }
    )
    return {
        **DEEPSEEK_V3.hf_header(),
        "num_key_value_heads": num_heads,
        "head_dim": head_dim,
        "rope_scaling": rope_scaling,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_shared_experts": moe.shared_experts,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": True,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "first_k_dense_replace": k,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": mla.nextn_layers,
    }


def mla_attention_weights(
    hidden: int, num_heads: int, mla: MLAPresetSpec, layer: int, rnd: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Layer `layer`'s self_attn tensors: q LoRA (or q_proj), kv_a_proj_with_mqa -> [latent | rope],
    kv_b_proj -> per head [k_nope | v], o_proj; norms at one."""
    p = f"model.layers.{layer}.self_attn."
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    w: dict[str, torch.Tensor] = {}
    if mla.q_lora_rank is None:
        w[p + "q_proj.weight"] = rnd(num_heads * qk, hidden)
    else:
        w[p + "q_a_proj.weight"] = rnd(mla.q_lora_rank, hidden)
        w[p + "q_a_layernorm.weight"] = torch.ones(mla.q_lora_rank)
        w[p + "q_b_proj.weight"] = rnd(num_heads * qk, mla.q_lora_rank)
    w[p + "kv_a_proj_with_mqa.weight"] = rnd(mla.kv_lora_rank + mla.qk_rope_head_dim, hidden)
    w[p + "kv_a_layernorm.weight"] = torch.ones(mla.kv_lora_rank)
    w[p + "kv_b_proj.weight"] = rnd(num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    w[p + "o_proj.weight"] = rnd(hidden, num_heads * mla.v_head_dim)
    return w


def mtp_layer_weights(
    hidden: int,
    layer: int,
    embed: torch.Tensor,
    head: torch.Tensor,
    rnd: Callable[..., torch.Tensor],
) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer's own tensors under DeepSeek-V3's hub names
    (model.layers.{layer}.): enorm, hnorm, eh_proj [hidden, 2 hidden] and shared_head.norm, with
    copies of the target's embedding and lm_head (the hub checkpoint stores copies too). Its
    decoder layer's tensors (norms, self_attn, mlp) are written as any layer's."""
    p = f"model.layers.{layer}."
    return {
        p + "enorm.weight": torch.ones(hidden),
        p + "hnorm.weight": torch.ones(hidden),
        p + "eh_proj.weight": rnd(hidden, 2 * hidden),
        p + "embed_tokens.weight": embed.clone(),
        p + "shared_head.norm.weight": torch.ones(hidden),
        p + "shared_head.head.weight": head.clone(),
    }
