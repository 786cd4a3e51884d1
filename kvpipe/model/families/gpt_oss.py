"""GPT-OSS: grouped-query attention with a learned sink logit per head, o_proj biased like q/k/v,
and alternating sliding-window and full layers (GQAttention reads all three from ModelConfig;
sink_attention.py runs them); RMSNorms with fp32 weights; and its own sparse MoE block.

The MoE block: the router is a biased linear; each token takes the top-k router logits and
weighs its experts by a softmax over those k only (moe.route, scoring "topk_softmax"). The
experts are stored fused as HF writes them: gate_up_proj [E, hidden, 2 * I] with gate and up
interleaved along the last dim (gate at even columns, up at odd), down_proj [E, I, hidden], each
with a bias, applied as x @ W (not x @ W^T). The activation is a clamped SwiGLU:
(clamp(up, -l, l) + 1) * g * sigmoid(a g) with g = clamp(gate, max=l).

Tensor parallelism slices every expert by its intermediate dim: a rank's I / tp gate/up pairs
are one contiguous, still interleaved range [2 i0, 2 (i0 + I/tp)) of gate_up_proj's last dim,
and the matching rows of down_proj. The partial sums of all experts are reduced once per block;
down_proj's bias is added once, after the reduction. Experts are dispatched as in moe.SparseMoE.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig, MoEConfig, layer_types
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.families.family import Family
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.linear import Shard
from kvpipe.model.layers.moe import Dispatch, Router, route
from kvpipe.model.layers.norms import RMSNorm


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2 * I] interleaved (gate, up) pairs -> [N, I]."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """All experts' fused weights, this rank's slice of the intermediate dim."""

    def __init__(self, moe: MoEConfig, hidden_size: int, parallel: ParallelConfig) -> None:
        super().__init__()
        e, tp = moe.num_experts, parallel.tp_size
        if moe.expert_intermediate_size % tp:
            raise ConfigError(
                f"expert intermediate size {moe.expert_intermediate_size} does not split over tp_size={tp}"
            )
        inter = moe.expert_intermediate_size // tp
        i0 = parallel.tp_rank * inter

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.gate_up_proj = param(e, hidden_size, 2 * inter)
        self.gate_up_proj_bias = param(e, 2 * inter)
        self.down_proj = param(e, inter, hidden_size)
        self.down_proj_bias = param(e, hidden_size)  # whole on every rank, added after the reduction
        self.param_shards = (
            {
                "gate_up_proj": Shard(2, 2 * i0, 2 * inter),
                "gate_up_proj_bias": Shard(1, 2 * i0, 2 * inter),
                "down_proj": Shard(1, i0, inter),
            }
            if tp > 1
            else {}
        )

    def partial(self, e: int, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """Expert e on its rows x [N, hidden] -> [N, hidden], without down_proj's bias (a partial
        sum under TP)."""
        h = clamped_swiglu(torch.addmm(self.gate_up_proj_bias[e], x, self.gate_up_proj[e]), alpha, limit)
        return h @ self.down_proj[e]


class GptOssMoE(nn.Module):
    """GPT-OSS's MLP: router + routed experts, one all-reduce per block."""

    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None or moe.scoring != "topk_softmax" or moe.swiglu_limit is None:
            raise ValueError("GptOssMoE needs GPT-OSS's MoEConfig (topk_softmax routing, clamped SwiGLU)")
        self.moe = moe
        self.swiglu_limit: float = moe.swiglu_limit
        self.layer = layer
        self.tp = parallel.tp_size > 1
        self.group = group
        self.router = Router(cfg.hidden_size, moe.num_experts, correction_bias=False, bias=True)
        self.experts = GptOssExperts(moe, cfg.hidden_size, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], reduced over the TP group."""
        moe, ex = self.moe, self.experts
        weights, experts = route(self.router(x), moe)  # [T, k] fp32, [T, k]
        plan = Dispatch.build(experts, moe.num_experts)
        xs = x.index_select(0, plan.tokens)  # [T * k, hidden], grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(plan.counts):
            if n:  # experts nobody chose cost nothing
                ys[start : start + n] = ex.partial(e, xs[start : start + n], moe.swiglu_alpha, self.swiglu_limit)
                start += n
        ys = (ys * weights.reshape(-1).index_select(0, plan.order)[:, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, plan.tokens, ys)
        if self.tp:
            dist.all_reduce(out, group=self.group)
        # sum_k w_k * down_bias[expert_k], once: [T, k, hidden] -> [T, hidden]
        bias = (weights[..., None] * ex.down_proj_bias[experts].float()).sum(dim=1)
        return out + bias.to(x.dtype)


class GptOssCausalLM(CausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.cfg, layer, self.parallel, self.group)

    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoE(self.cfg, layer, self.parallel, self.group)

    def make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.cfg.rms_norm_eps, fp32_weight=True)  # HF keeps these weights in fp32


def _alternating(layer: int) -> str:
    return "sliding_attention" if (layer + 1) % 2 else "full_attention"


def gpt_oss_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Biased attention (q/k/v and o_proj) with a sink per head; sliding and full layers (HF's
    default pattern alternates, sliding first); top-k softmax routing into biased experts with a
    clamped SwiGLU."""
    types = layer_types(raw, ("sliding_attention", "full_attention"), _alternating)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = raw.get("sliding_window")
    if sliding and (window is None or int(window) < 1):
        raise ConfigError(f"sliding_attention layers need a sliding_window >= 1, got {window!r}")
    moe = MoEConfig.hf(
        raw,
        int(raw["num_local_experts"]),
        "intermediate_size",
        scoring="topk_softmax",
        norm_topk_prob=False,
        biases=True,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    biased = bool(raw.get("attention_bias", True))
    return {
        "attention_bias": biased,
        "o_proj_bias": biased,
        "moe": moe,
        "sliding_window": None if window is None else int(window),
        "sliding_layers": sliding,
        "attention_sinks": True,
    }


GPT_OSS = Family("gpt_oss", ("GptOssForCausalLM",), "gpt_oss", GptOssCausalLM, config=gpt_oss_config)
