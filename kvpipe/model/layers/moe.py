"""Sparse mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE, MiniMax-M2, DeepSeek-V3), tensor-parallel.

A router picks top_k of num_experts routed experts per token (`route`, a pure function of the
router logits, following each family's HF implementation in fp32); the token-expert pairs are
grouped by expert (`dispatch`), each expert with tokens runs once on its rows, and the weighted
outputs are added back per token with one `index_add_`. No Python loop runs per token, only per
expert that received tokens.

Tensor parallelism slices every expert (and the shared expert) by its intermediate dim, exactly
like a dense MLP: each rank holds all experts, computes partial sums for every routed token and
adds the routed and shared partials before the block's single all-reduce. Qwen3.5-MoE's
shared-expert gate sigmoid(Linear(hidden, 1)) is replicated: a per-token scalar, it scales the
shared expert's partial sums on each rank before the reduce. Expert parallelism
(experts spread over ranks, tokens exchanged all-to-all) is out of scope.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig, MoEConfig
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.mlp import MLP

# DeepSeek-V3 adds this to the top-k weight sum before renormalising. In fp32 it cannot change a
# sum of sigmoid or softmax probabilities (far below their ulp), so every family shares it.
RENORM_EPS = 1e-20
SCORINGS = ("softmax", "sigmoid", "topk_softmax")


def route(
    logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] fp32 -> (weights [T, k] fp32, experts [T, k] int64).

    Scores are softmax (Qwen3-MoE) or sigmoid (MiniMax-M2, DeepSeek-V3) of the logits. The experts
    are chosen on score + correction_bias (when given), inside the best `topk_groups` groups when
    routing is group-limited, but weighted by the plain score; then optionally renormalised and
    scaled by routed_scaling_factor. GPT-OSS ("topk_softmax"): the top-k logits, then a softmax
    over those k only.
    """
    if moe.scoring == "topk_softmax":
        top = torch.topk(logits.float(), moe.top_k, dim=-1)
        return torch.softmax(top.values, dim=-1), top.indices
    if moe.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif moe.scoring == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        raise ConfigError(f"unsupported MoE scoring function {moe.scoring!r}; kvpipe supports {SCORINGS}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        choice = group_limited(choice, moe.num_groups, moe.topk_groups)
    experts = torch.topk(choice, moe.top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, experts


def group_limited(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V3: keep the experts of each token's best `topk_groups` of `num_groups` contiguous
    expert groups, a group scored by the sum of its two best choice scores; the rest get -inf.
    choice [T, E] -> [T, E]."""
    t, e = choice.shape
    group_scores = choice.view(t, num_groups, e // num_groups).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    keep = keep[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)
    return choice.masked_fill(~keep, float("-inf"))


@dataclass(frozen=True)
class Dispatch:
    """The T * k (token, slot) pairs of a routing, grouped by expert (ascending, stable)."""

    order: torch.Tensor  # [T * k] int64: index of each grouped pair into the flattened [T, k]
    tokens: torch.Tensor  # [T * k] int64: the token of each grouped pair
    counts: tuple[int, ...]  # [E]: pairs per expert, so expert e owns rows sum(counts[:e]) ...

    @classmethod
    def build(cls, experts: torch.Tensor, num_experts: int) -> Dispatch:
        """experts: [T, k] int64 from `route`."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        return cls(order, order // experts.shape[1], tuple(counts.tolist()))  # one host sync per block


class Router(nn.Module):
    """The routing linear [E, hidden] (with a bias [E] for GPT-OSS), replicated on every rank,
    and DeepSeek-V3/MiniMax-M2's e_score_correction_bias [E] (steers the choice of experts, not
    their weights)."""

    keep_fp32 = ("e_score_correction_bias",)  # the loader keeps it fp32 in a bf16 model, as HF does

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> router logits [T, E], computed in fp32 (DeepSeek-V3 does; for the
        others it is at least as precise as their half-precision linear)."""
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: routed experts (+ one fused shared expert), all-reduced once."""

    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None or not moe.is_sparse(layer):
            raise ValueError(f"layer {layer} has a dense MLP, not a sparse MoE block")
        check_routing(moe)
        self.moe = moe
        self.layer = layer
        self.tp = parallel.tp_size > 1
        self.group = group
        self.gate = Router(cfg.hidden_size, moe.num_experts, moe.correction_bias)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, moe.expert_intermediate_size, parallel, group, all_reduce=False)
            for _ in range(moe.num_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, moe.shared_intermediate_size, parallel, group, all_reduce=False)
            if moe.shared_intermediate_size
            else None
        )
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], reduced over the TP group."""
        weights, experts = route(self.gate(x), self.moe, self.gate.e_score_correction_bias)
        if self.moe.scoring == "softmax":
            weights = weights.to(x.dtype)  # HF Qwen3-MoE casts its weights to the activations' dtype
        plan = Dispatch.build(experts, self.moe.num_experts)
        xs = x.index_select(0, plan.tokens)  # [T * k, hidden], grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(plan.counts):
            if n:  # experts nobody chose cost nothing
                ys[start : start + n] = self.experts[e](xs[start : start + n])
                start += n
        ys = (ys * weights.reshape(-1).index_select(0, plan.order)[:, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, plan.tokens, ys)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] * [T, hidden]
            out = out + shared
        if self.tp:  # routed and shared partial sums together: one all-reduce per block
            dist.all_reduce(out, group=self.group)
        return out


def sparse_or_dense_mlp(
    cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None
) -> nn.Module:
    """The MLP of `layer`: a SparseMoE block where cfg.moe makes the layer sparse, else a dense MLP
    of cfg.intermediate_size."""
    if cfg.moe is not None and cfg.moe.is_sparse(layer):
        return SparseMoE(cfg, layer, parallel, group)
    return MLP(cfg.hidden_size, cfg.intermediate_size, parallel, group)


def check_routing(moe: MoEConfig) -> None:
    """Raise ConfigError for a routing `route` cannot do."""
    if moe.scoring not in SCORINGS:
        raise ConfigError(f"unsupported MoE scoring function {moe.scoring!r}; kvpipe supports {SCORINGS}")
    if not 0 < moe.top_k <= moe.num_experts:
        raise ConfigError(f"top_k={moe.top_k} experts out of {moe.num_experts}")
    if moe.num_groups > 1:
        per_group, rem = divmod(moe.num_experts, moe.num_groups)
        if rem or per_group < 2:  # a group is scored by its two best experts
            raise ConfigError(f"{moe.num_experts} experts do not split into {moe.num_groups} groups of >= 2")
        if not 0 < moe.topk_groups <= moe.num_groups or moe.top_k > moe.topk_groups * per_group:
            raise ConfigError(
                f"top_k={moe.top_k} experts from the best {moe.topk_groups} of "
                f"{moe.num_groups} groups of {per_group} is impossible"
            )
