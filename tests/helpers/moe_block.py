"""kvpipe's SparseMoE next to HF's sparse MoE block of each family (Qwen3-MoE, MiniMax-M2,
DeepSeek-V3): random HF blocks, the matching ModelConfig, and a SparseMoE loaded from the HF
block's whole tensors, each sliced by its TP shard as the loader does."""

from __future__ import annotations

import json
from typing import TypedDict

import torch
import transformers

from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.layers.moe import SparseMoE
from kvpipe.model.registry import model_config

HIDDEN = 64
ARCHS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
COMMON = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    initializer_range=0.1,
)


class MoeKwargs(TypedDict, total=False):
    """The MoE keyword arguments of the cases' HF configs (Qwen3MoeConfig, MiniMaxM2Config,
    DeepseekV3Config; each case sets only its family's)."""

    num_experts: int
    num_local_experts: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    n_shared_experts: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


# family -> HF config keyword arguments; sizes split over TP 4
HF_CONFIGS: dict[str, MoeKwargs] = {
    "qwen3_moe": MoeKwargs(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96),
    "qwen3_moe_renorm": MoeKwargs(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True
    ),
    "minimax_m2": MoeKwargs(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # 16 experts in 4 groups of 4, the best 2 groups per token, 4 experts from them, 2 shared experts
    "deepseek_v3": MoeKwargs(
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=16,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        intermediate_size=96,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
    ),
}
# without renormalised top-k weights and with one shared expert: the other routing branch
HF_CONFIGS["deepseek_v3_no_renorm"] = {**HF_CONFIGS["deepseek_v3"], "n_shared_experts": 1, "norm_topk_prob": False}


def family_of(case: str) -> str:
    return next(f for f in ARCHS if case.startswith(f))


def hf_config(case: str) -> transformers.PreTrainedConfig:
    cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "minimax_m2": transformers.MiniMaxM2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[family_of(case)]
    return cls(**COMMON, **HF_CONFIGS[case])


def our_config(hf_cfg: transformers.PreTrainedConfig, case: str) -> ModelConfig:
    raw = hf_cfg.to_dict() | {"architectures": [ARCHS[family_of(case)]]}
    return model_config(json.loads(json.dumps(raw)))  # as read from a config.json


@torch.no_grad()
def hf_block(case: str, seed: int = 0) -> tuple[transformers.PreTrainedConfig, torch.nn.Module]:
    """HF's sparse MoE block of `case` with random weights and a random correction bias."""
    cfg = hf_config(case)
    cls = {
        "qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
        "minimax_m2": transformers.models.minimax_m2.modeling_minimax_m2.MiniMaxM2SparseMoeBlock,
        "deepseek_v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
    }[family_of(case)]
    torch.manual_seed(seed)
    block = cls(cfg).eval()
    for _, t in [*block.named_parameters(), *block.named_buffers()]:
        t.normal_(0, 0.1)
    return cfg, block


def hf_block_state(block) -> dict[str, torch.Tensor]:
    """Our SparseMoE parameter names -> the whole (unsharded) tensors of an HF block, whose experts
    are fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    inter = block.experts.intermediate_dim
    state = {"gate.weight": block.gate.weight}
    bias = getattr(block, "e_score_correction_bias", getattr(block.gate, "e_score_correction_bias", None))
    if bias is not None:
        state["gate.e_score_correction_bias"] = bias
    for e in range(block.experts.num_experts):
        state[f"experts.{e}.gate_proj.weight"] = block.experts.gate_up_proj[e, :inter]
        state[f"experts.{e}.up_proj.weight"] = block.experts.gate_up_proj[e, inter:]
        state[f"experts.{e}.down_proj.weight"] = block.experts.down_proj[e]
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"shared_experts.{name}.weight"] = getattr(shared, name).weight
    return state


@torch.no_grad()
def load_sliced(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Fill `module` from whole tensors, each sliced by its module's Shard (as the loader does)."""
    shards = {f"{n}.weight": m.shard for n, m in module.named_modules() if getattr(m, "shard", None) is not None}
    params = dict(module.named_parameters())
    assert set(params) == set(state)
    for name, p in params.items():
        s = shards.get(name)
        p.copy_(state[name] if s is None else state[name].narrow(s.dim, s.start, s.length))


def ours_for(case: str, hf_cfg, block, parallel: ParallelConfig = ParallelConfig()) -> SparseMoE:
    cfg = our_config(hf_cfg, case)
    layer = 1  # sparse in every case (DeepSeek-V3's layer 0 is dense)
    moe = SparseMoE(cfg, layer, parallel, None)
    load_sliced(moe, hf_block_state(block))
    return moe.eval()
