"""Qwen3.5 text models, dense and MoE: a hybrid stack of gated delta-net layers (linear
attention, gated_delta_net.py, per-request recurrent state in a StatePool) and gated
full-attention layers (gated_attention.py, paged KV pool), same API as causal_lm.CausalLM (embed
/ forward_layers / compute_logits) plus the StatePool argument. The MoE variant differs only in
its MLP: a moe.SparseMoE block (softmax top-k, renormalised, plus a sigmoid-gated shared expert)
in every layer.

Differences from Llama/Qwen3 besides the token mixer: every RMSNorm (layer norms, final norm,
q/k norms) scales by (1 + weight), in fp32; full attention's q_proj also yields a per-head output
gate (o * sigmoid(gate) before o_proj); RoPE turns only the first head_dim * partial_rotary_factor
dims of q and k. Text-only positions make HF's multimodal RoPE sections (mrope) all equal, so
plain 1-D RoPE is exact here.

KV pool: only full-attention layers keep KV pages. The pool holds one buffer per full-attention
layer (cfg.kv_layers), and layer i's attention writes pool layer `kv_layers.index(i)`; with one
full layer in four (Qwen3.5's pattern) a pool of every layer would waste 3/4 of the KV memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import HybridConfig, LayerType, ModelConfig, MoEConfig
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.families.family import Family, qk_normed
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.gated_attention import GatedAttention
from kvpipe.model.layers.gated_delta_net import GatedDeltaNet, local_linear_heads
from kvpipe.model.layers.moe import sparse_or_dense_mlp
from kvpipe.model.layers.norms import ZeroCenteredRMSNorm


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        h = cfg.hybrid
        assert h is not None
        self.layer_type = h.layer_types[layer]
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, h.linear_layers.index(layer), parallel, group)
        else:
            self.self_attn = GatedAttention(cfg, cfg.kv_layers.index(layer), parallel, group)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = sparse_or_dense_mlp(cfg, layer, parallel, group)  # dense, or Qwen3.5-MoE's sparse block

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool, state: StatePool
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            h = self.linear_attn(h, batch, state)
        else:
            h = self.self_attn(h, cos, sin, batch, pool)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5CausalLM(LMBase):
    def __init__(
        self, cfg: ModelConfig, parallel: ParallelConfig = ParallelConfig(), group: dist.ProcessGroup | None = None
    ) -> None:
        if cfg.hybrid is None:
            raise ValueError("Qwen3_5CausalLM needs a ModelConfig with a HybridConfig")
        super().__init__(cfg, parallel, group)
        local_linear_heads(cfg.hybrid, parallel)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, parallel, group) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_layers(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        start: int,
        end: int,
        state: StatePool | None = None,
    ) -> torch.Tensor:
        """Run layers [start, end): full-attention layers write their K/V into `pool`, linear ones
        read and write the rows' slots of `state`."""
        self.check_layers(start, end)
        if state is None and any(self.layers[i].layer_type is LayerType.LINEAR_ATTENTION for i in range(start, end)):
            raise ValueError("linear-attention layers need a StatePool")
        cos, sin = self.rope(batch, hidden)  # [T, rotary_dim] each
        for i in range(start, end):
            hidden = self.layers[i](hidden, cos, sin, batch, pool, state)
        return hidden

    def forward(self, batch: ForwardBatch, pool: KVPool, state: StatePool | None = None) -> torch.Tensor:
        hidden = self.forward_layers(self.embed(batch), batch, pool, 0, self.cfg.num_layers, state)
        return self.compute_logits(hidden, batch)


# Qwen3.5-MoE's one shared expert is `shared_expert` (DeepSeek-V3's, like ours, `shared_experts`):
# (pattern, replacement) applied to our parameter's HF-style name (loader.hf_name)
MOE_CHECKPOINT_RENAMES = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),)


def qwen3_5_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The hybrid stack, q/k norms, and the MTP layers under mtp.* (mtp_num_hidden_layers: the hub
    configs' key; transformers' config class does not declare it and its models skip mtp.*)."""
    return qk_normed(raw) | {
        "hybrid": HybridConfig.from_hf_dict(raw),
        "num_nextn_predict_layers": int(raw.get("mtp_num_hidden_layers") or 0),
    }


def qwen3_5_moe_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's, with every layer sparse (HF has no decoder_sparse_step / mlp_only_layers here):
    softmax top-k, always renormalised, plus one gated shared expert; no dense MLP, hence no
    intermediate_size."""
    moe = MoEConfig.hf(
        raw,
        int(raw["num_experts"]),
        "moe_intermediate_size",
        scoring="softmax",
        norm_topk_prob=True,
        shared_intermediate_size=int(raw["shared_expert_intermediate_size"]),
        shared_expert_gate=True,
    )
    return qwen3_5_config(raw) | {"intermediate_size": int(raw.get("intermediate_size", 0)), "moe": moe}


def check_qwen3_5_moe(raw: dict[str, Any], cfg: ModelConfig) -> None:
    """HF's Qwen3.5-MoE makes every layer sparse, with one gated shared expert, and ignores the
    dense-layer keys of Qwen3-MoE; a config that carries them (or no shared expert) is asking for
    a model neither HF nor kvpipe builds."""
    unsupported = {
        "num_experts": int(raw.get("num_experts") or 0) < 1,
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0) < 1,
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1) != 1,
        "mlp_only_layers": bool(raw.get("mlp_only_layers")),
        "norm_topk_prob": raw.get("norm_topk_prob", True) is not True,  # HF always renormalises
    }
    bad = [f"{k}={raw.get(k)!r}" for k, v in unsupported.items() if v]
    if bad:
        raise ConfigError(f"Qwen3.5-MoE options not supported: {', '.join(bad)}")


QWEN3_5 = Family(
    "qwen3_5", ("Qwen3_5ForCausalLM",), "qwen3_5_text", Qwen3_5CausalLM, config=qwen3_5_config, partial_rotary=True
)
QWEN3_5_MOE = Family(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM",),
    "qwen3_5_moe_text",
    Qwen3_5CausalLM,
    config=qwen3_5_moe_config,
    check=check_qwen3_5_moe,
    checkpoint_renames=MOE_CHECKPOINT_RENAMES,
    partial_rotary=True,
)
