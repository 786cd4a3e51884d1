"""DeepSeek-V3: multi-head latent attention over a latent KV cache (mla.py) and a sparse MoE MLP
(sigmoid scores, bias-corrected group-limited top-k, shared experts, routed_scaling_factor) in
every layer after the first `first_k_dense_replace` dense ones.

Its multi-token-prediction layers, if a checkpoint has them, are not part of this model: the
NEXTN drafter loads the first one (model/draft/mtp.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.schema import MLAConfig, ModelConfig, MoEConfig
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.families.family import Family
from kvpipe.model.layers.mla import MLAttention
from kvpipe.model.layers.moe import sparse_or_dense_mlp


class DeepseekV3CausalLM(CausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return MLAttention(self.cfg, layer, self.parallel, self.group)

    def make_mlp(self, layer: int) -> nn.Module:
        return sparse_or_dense_mlp(self.cfg, layer, self.parallel, self.group)


def deepseek_v3_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Latent attention; sigmoid routing with group-limited top-k, shared experts and a weight
    scale after the first_k_dense_replace dense layers; the MTP layers the checkpoint holds."""
    n_layers = int(raw["num_hidden_layers"])
    first_dense = int(raw.get("first_k_dense_replace", 0))
    moe = MoEConfig.hf(
        raw,
        int(raw["n_routed_experts"]),
        "moe_intermediate_size",
        scoring="sigmoid",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        correction_bias=True,
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=int(raw.get("n_shared_experts") or 0) * int(raw["moe_intermediate_size"]),
        dense_layers=tuple(range(min(first_dense, n_layers))),
    )
    return {
        "moe": moe,
        "mla": MLAConfig.from_hf_dict(raw),
        "num_nextn_predict_layers": int(raw.get("num_nextn_predict_layers") or 0),
    }


def check_deepseek_v3(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """DeepSeek-V3 as HF runs it: sigmoid expert scores with bias-corrected group-limited top-k
    (V2-style softmax / greedy routing keys would be silently ignored). Multi-token-prediction
    layers (num_nextn_predict_layers) are fine: the target never runs them (model/draft/mtp.py does)."""
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func={raw['scoring_func']!r} is not supported for DeepSeek-V3 (only sigmoid)")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"topk_method={raw['topk_method']!r} is not supported for DeepSeek-V3 (only noaux_tc)")
    if int(raw.get("qk_rope_head_dim", 0)) % 2:
        raise ConfigError(f"qk_rope_head_dim={raw['qk_rope_head_dim']} must be even (RoPE rotates pairs)")


DEEPSEEK_V3 = Family(
    "deepseek_v3",
    ("DeepseekV3ForCausalLM",),
    "deepseek_v3",
    DeepseekV3CausalLM,
    config=deepseek_v3_config,
    check=check_deepseek_v3,
)
