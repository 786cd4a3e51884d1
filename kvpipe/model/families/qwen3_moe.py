"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) and a sparse MoE MLP (softmax top-k,
renormalised when norm_topk_prob) in every layer but the dense ones (mlp_only_layers,
decoder_sparse_step)."""

from __future__ import annotations

from typing import Any

from torch import nn

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.schema import ModelConfig, MoEConfig
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.families.family import Family, qk_normed
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.moe import sparse_or_dense_mlp


class Qwen3MoeCausalLM(CausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.cfg, layer, self.parallel, self.group)

    def make_mlp(self, layer: int) -> nn.Module:
        return sparse_or_dense_mlp(self.cfg, layer, self.parallel, self.group)


def qwen3_moe_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3's q/k norms; softmax routing, dense layers where mlp_only_layers or decoder_sparse_step say."""
    n_layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    moe = MoEConfig.hf(
        raw,
        int(raw.get("num_experts") or raw["num_local_experts"]),
        "moe_intermediate_size",
        scoring="softmax",
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(n_layers) if i in only or (i + 1) % step),
    )
    return qk_normed(raw) | {"moe": moe}


def check_qwen3_moe(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """A Qwen3-MoE config without experts has no sparse layer: not a model this family builds."""
    if cfg.moe is not None and cfg.moe.num_experts == 0:
        raise ConfigError("qwen3_moe with num_experts=0 (no sparse layer) is not supported")


QWEN3_MOE = Family(
    "qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3_moe", Qwen3MoeCausalLM, config=qwen3_moe_config, check=check_qwen3_moe
)
