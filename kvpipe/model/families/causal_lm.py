"""What every family's causal LM shares, over a paged KV pool with model-level tensor
parallelism: the token embedding, the RoPE tables, the final norm and the logits (LMBase), and
the stack of pre-norm DecoderLayers whose parts each family builds (CausalLM). The forward is
split (embed, layer range, logits) so the engine can run a prefill in layer groups and ship each
group's KV while the next group computes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.cpu.fused_decode import FusedDecodeLayers
from kvpipe.model.cpu.packed_linear import can_pack
from kvpipe.model.cpu.panel_weight import Bf16PanelWeight, PanelWeight, bf16_panels, panel_kernels
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.decoder_layer import DecoderLayer
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.norms import RMSNorm
from kvpipe.model.layers.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from kvpipe.model.quant.kv_scales import KVScales
from kvpipe.model.quant.weights import Int8Weight


class LMBase(nn.Module):
    """What every family's causal LM shares: the token embedding, the RoPE tables, the final norm
    and the logits. A subclass builds `layers`, `norm` and `lm_head` and runs `forward_layers`.
    Embedding and lm_head are replicated on every rank: simple and bit-exact across TP sizes."""

    layers: nn.ModuleList
    norm: nn.Module
    # (hidden, batch, pool, start, end) -> hidden, a hybrid family also takes its StatePool:
    # declared so callers holding an LMBase see a callable, not nn.Module.__getattr__'s Tensor
    forward_layers: Callable[..., torch.Tensor]

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        check_parallel(cfg, parallel)
        self.cfg = cfg
        self.parallel = parallel
        self.group = group
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        # Tied: logits reuse embed_tokens (no second parameter that a device move could untie).
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        # --quantization with tied embeddings: an int8 copy of the table for the logits (quantization.py)
        self.head_quant: Int8Weight | None = None
        # fp32 on the CPU with tied embeddings: a panel copy of the table for the logits (pack_head)
        self.head_panel: PanelWeight | Bf16PanelWeight | None = None
        # fp8 KV-cache scales per KV layer (the loader reads the checkpoint's; kv_scales.py)
        self.kv_scales = KVScales.ones(len(cfg.kv_layers))
        # the decode step's layers as one C++ call each (--decode-fused-layer; fused_decode.py),
        # set once loaded by enable_fused_decode; None: the module path
        self.fused_decode: FusedDecodeLayers | None = None
        self.init_rope()

    def init_rope(self, device: str | torch.device | None = None) -> None:
        """RoPE inverse frequencies and yarn's cos/sin multiplier. A plain attribute, not a buffer:
        inv_freq stays fp32 when the weights move to bf16 (the loader calls this again after
        building on the meta device)."""
        cfg = self.cfg
        self.inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        if device is not None:
            self.inv_freq = self.inv_freq.to(device)
        self.rope_attention_factor = rope_attention_factor(cfg.rope_scaling, cfg.max_position_embeddings)

    def rope(self, batch: ForwardBatch, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim] of the batch's positions, in `like`'s dtype, on its device."""
        if self.inv_freq.device != like.device:
            self.inv_freq = self.inv_freq.to(like.device)
        return rope_cos_sin(self.inv_freq, batch.positions, like.dtype, self.rope_attention_factor)

    def pack_head(self) -> bool:
        """Tied logits on the CPU: multiply by a panel copy of the fp32 or bf16 embedding table (the lookup
        keeps the dense one), the kernel every other fp32 projection runs (panel_weight.py): one
        order of sums at any row count; --quantization's int8 copy goes into panels too. False
        where there is nothing to pack."""
        ext = panel_kernels()
        if self.lm_head is not None or ext is None or self.embed_tokens.device.type != "cpu":
            return False
        if self.head_quant is not None:
            self.head_quant.pack(int(ext.f32_panel_width()))
            return True
        self.head_panel = bf16_panels(self.embed_tokens)  # bf16: its own kernel (bf16_panel.cpp)
        if self.head_panel is not None:
            return True
        if not can_pack(self.embed_tokens):
            return False
        self.head_panel = PanelWeight.pack(self.embed_tokens, ext)
        return True

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank stores: the KVPool of this rank must be built with this many."""
        return self.parallel.local_kv_heads(self.cfg.kv_cache_heads)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        return F.embedding(batch.input_ids, self.embed_tokens)

    def check_layers(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= self.cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {self.cfg.num_layers})")

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final norm + lm_head on the rows in batch.logit_indices -> [B_out, vocab] fp32."""
        h = self.norm(hidden[batch.logit_indices])
        if self.lm_head is None:  # tied: the embedding table (dense, the lookup needs it) or a copy
            if self.head_quant is not None:
                return self.head_quant(h).float()
            if self.head_panel is not None:
                return self.head_panel(h).float()
            return F.linear(h, self.embed_tokens).float()
        return self.lm_head(h).float()


class CausalLM(LMBase, ABC):
    """A stack of DecoderLayers: a family says what attention, MLP and norm each layer has."""

    def __init__(
        self, cfg: ModelConfig, parallel: ParallelConfig = ParallelConfig(), group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(cfg, parallel, group)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.norm = self.make_norm(cfg.hidden_size)

    def make_layer(self, layer: int) -> nn.Module:
        """Layer `layer`: (x, cos, sin, batch, pool) -> [T, hidden] (a pre-norm DecoderLayer here)."""
        h = self.cfg.hidden_size
        return DecoderLayer(self.make_norm(h), self.make_attention(layer), self.make_norm(h), self.make_mlp(layer))

    @abstractmethod
    def make_attention(self, layer: int) -> nn.Module:
        """Layer `layer`'s attention: (x, cos, sin, batch, pool) -> [T, hidden]."""

    @abstractmethod
    def make_mlp(self, layer: int) -> nn.Module:
        """Layer `layer`'s MLP (dense or sparse): [T, hidden] -> [T, hidden], reduced over the TP group."""

    def make_norm(self, dim: int) -> nn.Module:
        """The layer norms and the final norm."""
        return RMSNorm(dim, self.cfg.rms_norm_eps)

    def forward_layers(
        self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool, start: int, end: int
    ) -> torch.Tensor:
        """Run layers [start, end); writes their K/V into `pool` (global layer index)."""
        self.check_layers(start, end)
        cos, sin = self.rope(batch, hidden)
        fused = self.fused_decode
        if fused is not None and fused.takes(batch, pool, hidden, start, end):
            return fused.run(hidden, cos, sin, batch, pool, start, end)
        for i in range(start, end):
            hidden = self.layers[i](hidden, cos, sin, batch, pool)
        return hidden

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        hidden = self.forward_layers(self.embed(batch), batch, pool, 0, self.cfg.num_layers)
        return self.compute_logits(hidden, batch)


def check_parallel(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ConfigError when the model does not split over parallel.tp_size."""
    if not 0 <= parallel.tp_rank < parallel.tp_size:
        raise ConfigError(f"tp_rank={parallel.tp_rank} outside tp_size={parallel.tp_size}")
    parallel.local_heads(cfg.num_heads)
    if cfg.mla is None:  # MLA has no KV heads to split: its one latent is replicated on every rank
        parallel.local_kv_heads(cfg.num_kv_heads)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"{cfg.num_heads} heads are not a multiple of {cfg.num_kv_heads} KV heads")
    moe = cfg.moe
    sizes = {"intermediate_size": cfg.intermediate_size} if moe is None or moe.dense_layers else {}
    if moe is not None:
        sizes.update(
            expert_intermediate_size=moe.expert_intermediate_size, shared_intermediate_size=moe.shared_intermediate_size
        )
    for name, size in sizes.items():
        if size % parallel.tp_size:
            raise ConfigError(f"{name}={size} does not split over tp_size={parallel.tp_size}")
