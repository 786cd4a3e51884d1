"""Built-in Qwen3.5 (hybrid) presets: deterministic random weights as a real HF Qwen3_5ForCausalLM
(or, with a `moe` spec, Qwen3_5MoeForCausalLM) checkpoint, loadable by transformers. Kept apart
from llama.PresetSpec so the Llama presets' files (their kvpipe_preset.json embeds the spec)
stay byte-identical; a dense spec's file has no `moe` key (writer._spec_json drops it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpipe.model.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from kvpipe.model.presets.scale import WEIGHT_GAIN


@dataclass(frozen=True)
class Qwen3_5MoeSpec:
    """Qwen3.5-MoE's MLP, in every layer: routed experts (softmax top-k, renormalised) and one
    shared expert behind a sigmoid gate."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    router_std: float = 0.5  # router logits spread enough that the choice of experts is clear


@dataclass(frozen=True)
class Qwen3_5PresetSpec:
    num_layers: int
    full_attention_interval: int  # every n-th layer is full attention, the others gated delta-net
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int = 4
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    weight_gain: float = WEIGHT_GAIN  # a projection's std is weight_gain / sqrt(fan_in)
    embed_std: float = 1.0
    conv_std: float = 0.3
    moe: Qwen3_5MoeSpec | None = None  # None: the dense MLP of intermediate_size (Qwen3.5)
    # multi-token-prediction layers under mtp.* (HF's mtp_num_hidden_layers; the NEXTN drafter,
    # model/draft/qwen3_5_mtp.py), drawn after every target tensor so the target's stay as they were
    mtp_layers: int = 0

    @property
    def layer_types(self) -> list[str]:
        return [
            "linear_attention" if (i + 1) % self.full_attention_interval else "full_attention"
            for i in range(self.num_layers)
        ]


QWEN3_5_PRESETS: dict[str, Qwen3_5PresetSpec] = {
    # 3 delta-net layers then 1 full-attention layer; heads split over TP 1, 2 and 4
    "tiny-qwen3.5": Qwen3_5PresetSpec(
        num_layers=4,
        full_attention_interval=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        mtp_layers=1,
    ),
    # the same stack with 8 experts of 64 (top 2) and a shared expert of 128 in every layer
    "tiny-qwen3.5-moe": Qwen3_5PresetSpec(
        num_layers=4,
        full_attention_interval=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=0,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        moe=Qwen3_5MoeSpec(num_experts=8, top_k=2, expert_intermediate_size=64, shared_intermediate_size=128),
        mtp_layers=1,
    ),
}


def hf_config(spec: Qwen3_5PresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    if spec.moe is not None:
        m = spec.moe
        dense = {k: v for k, v in _dense_config(spec, vocab_size, bos, eos).items() if k != "intermediate_size"}
        return (
            dense
            | QWEN3_5_MOE.hf_header()
            | {
                "num_experts": m.num_experts,
                "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.expert_intermediate_size,
                "shared_expert_intermediate_size": m.shared_intermediate_size,
            }
        )
    return _dense_config(spec, vocab_size, bos, eos)


def _dense_config(spec: Qwen3_5PresetSpec, vocab_size: int, bos: int, eos: int) -> dict:
    return {
        **QWEN3_5.hf_header(),
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "layer_types": spec.layer_types,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "linear_num_key_heads": spec.linear_key_heads,
        "linear_num_value_heads": spec.linear_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.conv_kernel,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": spec.partial_rotary_factor,
        },
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "float32",
        "use_cache": True,
        **({"mtp_num_hidden_layers": spec.mtp_layers} if spec.mtp_layers else {}),
    }


def weights(spec: Qwen3_5PresetSpec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = spec.hidden_size
    nk, nv = spec.linear_key_heads, spec.linear_value_heads
    dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
    conv_dim = 2 * nk * dk + nv * dv

    def rnd(*shape: int, std: float | None = None) -> torch.Tensor:
        """Random [out, in] weights of std weight_gain / sqrt(in), or of `std`."""
        scale = spec.weight_gain / math.sqrt(shape[-1]) if std is None else std
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    w = {"model.embed_tokens.weight": rnd(vocab_size, h, std=spec.embed_std)}
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.zeros(h)  # Qwen3.5 norms scale by (1 + weight)
        w[p + "post_attention_layernorm.weight"] = torch.zeros(h)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = rnd(conv_dim, h)
            w[a + "in_proj_z.weight"] = rnd(nv * dv, h)
            w[a + "in_proj_b.weight"] = rnd(nv, h)
            w[a + "in_proj_a.weight"] = rnd(nv, h)
            w[a + "conv1d.weight"] = rnd(conv_dim, 1, spec.conv_kernel, std=spec.conv_std)
            w[a + "dt_bias"] = torch.ones(nv)
            # HF's init: A uniform in [0.01, 16), stored as log
            w[a + "A_log"] = (torch.rand(nv, generator=g, dtype=torch.float32) * 15.99 + 0.01).log()
            w[a + "norm.weight"] = torch.ones(dv)
            w[a + "out_proj.weight"] = rnd(h, nv * dv)
        else:
            w |= _full_attention_weights(spec, p + "self_attn.", rnd)
        w |= _mlp_weights(spec, p + "mlp.", rnd)
    w["model.norm.weight"] = torch.zeros(h)
    w["lm_head.weight"] = rnd(vocab_size, h)
    if spec.mtp_layers:  # drawn after the target's: its tensors are those of a preset without
        w |= _mtp_weights(spec, rnd)
    return w


def _full_attention_weights(spec: Qwen3_5PresetSpec, a: str, rnd) -> dict[str, torch.Tensor]:
    """A gated full-attention layer's tensors under prefix a ("model.layers.i.self_attn.")."""
    h, d = spec.hidden_size, spec.head_dim
    return {
        a + "q_proj.weight": rnd(spec.num_heads * 2 * d, h),  # query and output gate per head
        a + "k_proj.weight": rnd(spec.num_kv_heads * d, h),
        a + "v_proj.weight": rnd(spec.num_kv_heads * d, h),
        a + "o_proj.weight": rnd(h, spec.num_heads * d),
        a + "q_norm.weight": torch.zeros(d),
        a + "k_norm.weight": torch.zeros(d),
    }


def _mlp_weights(spec: Qwen3_5PresetSpec, p: str, rnd) -> dict[str, torch.Tensor]:
    """A layer's MLP under prefix p ("model.layers.i.mlp."): dense, or the MoE block."""
    if spec.moe is not None:
        return _moe_weights(spec.moe, spec.hidden_size, p, rnd)
    h, inter = spec.hidden_size, spec.intermediate_size
    return {
        p + "gate_proj.weight": rnd(inter, h),
        p + "up_proj.weight": rnd(inter, h),
        p + "down_proj.weight": rnd(h, inter),
    }


def _mtp_weights(spec: Qwen3_5PresetSpec, rnd) -> dict[str, torch.Tensor]:
    """The MTP layers under Qwen3.5's hub names: fc [hidden, 2 hidden] over the normed embedding
    and hidden state, the two pre-fc norms and the final mtp.norm (shared by the layers), and each
    full-attention decoder layer (mtp.layers.i.); no embedding or head of their own (the target's
    are shared)."""
    h = spec.hidden_size
    w = {"mtp.fc.weight": rnd(h, 2 * h)}
    for i in range(spec.mtp_layers):
        p = f"mtp.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.zeros(h), p + "post_attention_layernorm.weight": torch.zeros(h)}
        w |= _full_attention_weights(spec, p + "self_attn.", rnd)
        w |= _mlp_weights(spec, p + "mlp.", rnd)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[f"mtp.{name}.weight"] = torch.zeros(h)
    return w


def _moe_weights(moe: Qwen3_5MoeSpec, h: int, p: str, rnd) -> dict[str, torch.Tensor]:
    """One layer's MoE block under prefix p ("model.layers.i.mlp."), in the per-expert names HF's
    save_pretrained writes (and loads back into its fused experts)."""
    w = {
        p + "gate.weight": rnd(moe.num_experts, h, std=moe.router_std),
        p + "shared_expert_gate.weight": rnd(1, h, std=moe.router_std),
    }
    for name, inter in [(f"experts.{e}.", moe.expert_intermediate_size) for e in range(moe.num_experts)] + [
        ("shared_expert.", moe.shared_intermediate_size)
    ]:
        w[p + name + "gate_proj.weight"] = rnd(inter, h)
        w[p + name + "up_proj.weight"] = rnd(inter, h)
        w[p + name + "down_proj.weight"] = rnd(h, inter)
    return w
