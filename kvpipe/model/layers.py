"""Building blocks of a Llama/Qwen decoder layer, tensor-parallel aware.

Column-parallel projections (q/k/v, gate/up) hold a slice of output rows; row-parallel ones
(o_proj, down_proj) hold a slice of input columns and all-reduce their partial sums. Each
sharded Linear carries its `Shard`, so the loader slices checkpoint tensors without knowing the
model family. Parameters are allocated uninitialised: the loader fills every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.attention import paged_attention
from kvpipe.model.config import ModelConfig
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.packed_linear import can_pack, pack_weight, packed_linear
from kvpipe.model.qk_norm import ShardedRMSNorm, whole_qk_norm
from kvpipe.model.rope import apply_rope


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint weight [out, in] one TP rank holds: [start, start + length) along
    dim 0 (column-parallel: output rows; a bias is sliced alike) or dim 1 (row-parallel: input
    columns; a bias stays whole). Other modules' parameters (`param_shards`, e.g. GPT-OSS's fused
    experts [E, hidden, 2 I]) may name any dim."""

    dim: int
    start: int
    length: int
    # further (start, length) ranges along `dim`, concatenated after the first: a fused projection
    # whose parts (q, k, v of a gated delta-net) each split by heads
    more: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.length), *self.more)

    @classmethod
    def rows(cls, parallel: ParallelConfig, start: int, length: int) -> Shard | None:
        return cls(0, start, length) if parallel.tp_size > 1 else None

    @classmethod
    def cols(cls, parallel: ParallelConfig, start: int, length: int) -> Shard | None:
        return cls(1, start, length) if parallel.tp_size > 1 else None


class Linear(nn.Module):
    """y = x W^T (+ b), weights [out, in] as in HF checkpoints; allocated empty."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        all_reduce: bool = False,
        group: dist.ProcessGroup | None = None,
        shard: Shard | None = None,
        packable: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.packable = packable  # False: other code reads the dense weight (MLA's absorbed kv_b_proj)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.all_reduce = all_reduce  # row-parallel: sum partial products across the TP group
        self.group = group
        self.shard = shard  # None: the whole checkpoint tensor

    def pack(self) -> bool:
        """Swap the dense weight for its oneDNN-packed form (packed_linear.py), once loaded;
        False where it cannot be packed (not CPU fp32)."""
        if not (self.packable and can_pack(self.weight)):
            return False
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return packed_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.all_reduce:
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        dist.all_reduce(y, group=self.group)
        # the bias is replicated: add it once, after the reduction
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # GPT-OSS: an fp32 weight (HF keeps these norms in fp32), applied before casting back
        self.fp32_weight = fp32_weight
        self.keep_fp32 = ("weight",) if fp32_weight else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, weight applied after casting back (HF LlamaRMSNorm order)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.head_dim
        self.num_heads = parallel.local_heads(cfg.num_heads)
        self.num_kv_heads = parallel.local_kv_heads(cfg.num_kv_heads)
        self.scale = cfg.head_dim**-0.5
        tp = parallel.tp_size > 1
        d, bias = cfg.head_dim, cfg.attention_bias
        q0, kv0 = parallel.tp_rank * self.num_heads * d, parallel.kv_head_start(cfg.num_kv_heads) * d
        q_rows, kv_rows = Shard.rows(parallel, q0, self.num_heads * d), Shard.rows(parallel, kv0, self.num_kv_heads * d)
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * d, bias, shard=q_rows)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, shard=kv_rows)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, bias, shard=kv_rows)
        self.o_proj = Linear(
            self.num_heads * d,
            cfg.hidden_size,
            cfg.o_proj_bias,
            all_reduce=tp,
            group=group,
            shard=Shard.cols(parallel, q0, self.num_heads * d),
        )
        self.group = group
        # GPT-OSS: a sink logit per query head (this rank's heads) and, in sliding layers, a window
        self.window = cfg.window(layer)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if cfg.attention_sinks else None
        self.param_shards = (
            {"sinks": Shard(0, parallel.tp_rank * self.num_heads, self.num_heads)} if cfg.attention_sinks and tp else {}
        )
        self.q_norm: RMSNorm | ShardedRMSNorm | None = None
        self.k_norm: RMSNorm | ShardedRMSNorm | None = None
        if cfg.qk_norm and cfg.qk_norm_per_head:
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm:  # over all heads: sliced like q/k; KV heads replicated when tp > KV heads
            self.q_norm = ShardedRMSNorm(cfg.num_heads * d, q_rows, self.num_heads * d, cfg.rms_norm_eps)
            self.k_norm = ShardedRMSNorm(
                cfg.num_kv_heads * d,
                kv_rows,
                self.num_kv_heads * d,
                cfg.rms_norm_eps,
                replicas=max(1, parallel.tp_size // cfg.num_kv_heads),
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if isinstance(self.q_norm, ShardedRMSNorm):  # MiniMax-M2: RMSNorm over all heads of q (of k)
            q, k = whole_qk_norm(q, k, self.q_norm, self.k_norm, self.group)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if isinstance(self.q_norm, RMSNorm):  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, self.layer, batch, pool, self.scale, self.sinks, self.window)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), split over TP ranks by the intermediate dim.

    all_reduce=False leaves down_proj's partial sums unreduced, for a caller (an MoE block)
    that adds several MLPs' outputs and reduces once.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelConfig,
        group: dist.ProcessGroup | None,
        all_reduce: bool = True,
    ) -> None:
        super().__init__()
        if intermediate_size % parallel.tp_size:
            raise ConfigError(f"intermediate size {intermediate_size} does not split over tp_size={parallel.tp_size}")
        inter = intermediate_size // parallel.tp_size
        i0 = parallel.tp_rank * inter
        rows = Shard.rows(parallel, i0, inter)
        self.gate_proj = Linear(hidden_size, inter, shard=rows)
        self.up_proj = Linear(hidden_size, inter, shard=rows)
        self.down_proj = Linear(
            inter,
            hidden_size,
            all_reduce=all_reduce and parallel.tp_size > 1,
            group=group,
            shard=Shard.cols(parallel, i0, inter),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_attention(
    cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None
) -> nn.Module:
    """One layer's attention: MLA over a latent cache (DeepSeek-V3), else GQA/MHA."""
    if cfg.mla is not None:
        from kvpipe.model.mla import MLAttention  # imported here: mla.py builds on this module's Linear

        return MLAttention(cfg, layer, parallel, group)
    return Attention(cfg, layer, parallel, group)


def make_mlp(cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> nn.Module:
    """The MLP of `layer`: a sparse MoE block where the model has one there, else a dense MLP."""
    if cfg.architecture == "gpt_oss":
        from kvpipe.model.gpt_oss_moe import GptOssMoE  # fused biased experts, clamped SwiGLU

        return GptOssMoE(cfg, layer, parallel, group)
    if cfg.moe is not None and cfg.moe.is_sparse(layer):
        from kvpipe.model.moe import SparseMoE  # moe.py builds its experts from MLP above

        return SparseMoE(cfg, layer, parallel, group)
    return MLP(cfg.hidden_size, cfg.intermediate_size, parallel, group)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        fp32_norm = cfg.architecture == "gpt_oss"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32_norm)
        self.self_attn = make_attention(cfg, layer, parallel, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32_norm)
        self.mlp = make_mlp(cfg, layer, parallel, group)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return h + self.mlp(self.post_attention_layernorm(h))
