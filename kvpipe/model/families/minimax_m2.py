"""MiniMax-M2: grouped-query attention with an RMSNorm over the whole q (and k) projection, all
heads together (norms.whole_qk_norm), and partial rotary; a sparse MoE MLP in every layer
(sigmoid scores, top-k chosen with a correction bias, weights renormalised).

Its checkpoints keep Mixtral's names for the MoE block (`block_sparse_moe`, experts w1 gate, w3
up, w2 down) and hold the correction bias on the block, not on the router: CHECKPOINT_RENAMES.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.schema import ModelConfig, MoEConfig
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.families.family import Family
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.moe import sparse_or_dense_mlp

# (pattern, replacement) applied in order to our parameter's HF-style name (loader.hf_name)
CHECKPOINT_RENAMES = (
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.e_score_correction_bias"),
    (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".mlp.experts.\1.w1."),
    (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".mlp.experts.\1.w3."),
    (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".mlp.experts.\1.w2."),
    (r"\.mlp\.", ".block_sparse_moe."),
)


class MiniMaxM2CausalLM(CausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.cfg, layer, self.parallel, self.group)

    def make_mlp(self, layer: int) -> nn.Module:
        return sparse_or_dense_mlp(self.cfg, layer, self.parallel, self.group)


def minimax_m2_config(raw: dict[str, Any]) -> dict[str, Any]:
    """One RMSNorm over the whole q (and k) projection; sigmoid routing steered by a correction
    bias, weights renormalised, in every layer (intermediate_size is the expert size)."""
    moe = MoEConfig.hf(
        raw,
        int(raw["num_local_experts"]),
        "intermediate_size",
        scoring="sigmoid",
        norm_topk_prob=True,
        correction_bias=True,
    )
    return {"qk_norm": True, "qk_norm_per_head": False, "moe": moe}


def check_minimax_m2(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """Options of MiniMax checkpoints' own config.json that HF's MiniMaxM2 model (and kvpipe's)
    does not implement: anything but sigmoid scoring with a routing bias, full-projection q/k
    norms, full attention in every layer, no shared expert."""
    unsupported = {
        "scoring_func": raw.get("scoring_func", "sigmoid") != "sigmoid",
        "use_routing_bias": raw.get("use_routing_bias", True) is not True,
        "use_qk_norm": raw.get("use_qk_norm", True) is not True,
        "qk_norm_type": raw.get("qk_norm_type", "per_layer") != "per_layer",
        "attn_type_list": any(int(t) != 1 for t in raw.get("attn_type_list") or ()),  # 0: lightning attention
        "shared_intermediate_size": int(raw.get("shared_intermediate_size") or 0) != 0,
    }
    bad = [f"{k}={raw[k]!r}" for k, v in unsupported.items() if v]
    if bad:
        raise ConfigError(f"MiniMax-M2 options not supported: {', '.join(bad)}")


MINIMAX_M2 = Family(
    "minimax_m2",
    ("MiniMaxM2ForCausalLM",),
    "minimax_m2",
    MiniMaxM2CausalLM,
    config=minimax_m2_config,
    check=check_minimax_m2,
    checkpoint_renames=CHECKPOINT_RENAMES,
    partial_rotary=True,
)
