"""DeepSeek-V3's multi-token-prediction (MTP) layer, the NEXTN drafter's model, as the hub
checkpoints store it (`num_nextn_predict_layers`, tensors under model.layers.{num_layers + i}.)
and SGLang runs it (python/sglang/srt/models/deepseek_nextn.py):

    x   = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))     [T, 2 hidden] -> [T, hidden]
    x   = decoder_layer(x)                                     MLA + MoE, its own one-layer KV
    out = shared_head.norm(x)                                  the hidden state the next step feeds
    logits = shared_head.head(out)                             a guess at t_{i+2}

h_i is the target's last hidden state at position i AFTER its final norm (what SGLang's
DeepseekV2Model returns and its EAGLE worker captures), t_{i+1} the token that followed; the MTP
runs at position i (RoPE and KV slot of i). Chained drafts feed `out` back as h.

And `load_mtp`, every family's loader: the family's MTPLayer (mtp_layer.py; Qwen3.5's in
qwen3_5_mtp.py) built from the checkpoint's tensors, each named by the layer's tensor_name.

Built for TP 1: with a TP target the drafter runs it whole on rank 0, where the target's hidden
states, embedding and lm_head are complete (replicated on every rank). `embed_tokens` and `shared_head.head` are the
checkpoint's copies when it has them, else the target's (load_mtp's `embed`, `head`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.gguf.checkpoint import gguf_checkpoint
from kvpipe.model.checkpoint.loader import keep_fp32, pack_linears, resolve_dtype, weight_files
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.cpu.packed_linear import packing_enabled
from kvpipe.model.draft.mtp_layer import MTPLayer, copy_checkpoint_tensors
from kvpipe.model.draft.qwen3_5_mtp import Qwen3_5MTP
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.decoder_layer import DecoderLayer
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.mla import MLAttention
from kvpipe.model.layers.moe import sparse_or_dense_mlp
from kvpipe.model.layers.norms import RMSNorm


class SharedHead(nn.Module):
    """The MTP layer's output head: a norm, and the vocabulary projection (None: the target's)."""

    def __init__(self, cfg: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size) if own_head else None


class DeepseekMTP(MTPLayer):
    """One MTP layer over a one-layer latent KV pool (layer 0 of `pool`)."""

    def __init__(self, cfg: ModelConfig, layer: int, own_embed: bool = True, own_head: bool = True) -> None:
        """`layer`: the checkpoint's index of this MTP layer (num_layers + i): its MLP is sparse
        or dense as a decoder layer of that index would be."""
        if cfg.mla is None:
            raise ConfigError(f"the MTP layer is DeepSeek-V3's (MLA); {cfg.architecture} has none")
        super().__init__(cfg, layer - cfg.num_layers, own_embed)
        parallel = ParallelConfig()
        self.layer = layer
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        # the attention writes layer 0 of the MTP's own pool; the MLP is the checkpoint layer's
        attn = MLAttention(cfg, 0, parallel, None)
        self.decoder = DecoderLayer(
            RMSNorm(h, cfg.rms_norm_eps),
            attn,
            RMSNorm(h, cfg.rms_norm_eps),
            sparse_or_dense_mlp(cfg, layer, parallel, None),
        )
        self.shared_head = SharedHead(cfg, own_head)

    @classmethod
    def from_names(cls, cfg: ModelConfig, index: int, names: set[str]) -> DeepseekMTP:
        """MTP layer `index`, with its own embedding and head where the checkpoint has copies."""
        layer = cfg.num_layers + index
        own_embed = mtp_tensor_name("embed_tokens", layer) in names
        own_head = mtp_tensor_name("shared_head.head.weight", layer) in names
        return cls(cfg, layer, own_embed, own_head)

    @property
    def own_head(self) -> nn.Module | None:
        return self.shared_head.head

    def tensor_name(self, name: str) -> str:
        return mtp_tensor_name(name, self.layer)

    def kv_pool(self, num_pages: int, page_size: int, device: str | torch.device) -> KVPool:
        """One latent layer (MLA: one buffer, no head axis)."""
        mla = self.cfg.mla
        assert mla is not None
        dtype = next(self.parameters()).dtype
        return KVPool(1, num_pages, page_size, 1, mla.latent_dim, dtype, device, latent=True, compute_dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.enorm(self.embed(batch.input_ids)), self.hnorm(hidden)], dim=-1)
        x = self.eh_proj(x)
        cos, sin = self.rope(batch, x)
        out = self.shared_head.norm(self.decoder(x, cos, sin, batch, pool))
        return out, self.logits(out[batch.logit_indices])


def mtp_tensor_name(name: str, layer: int) -> str:
    """Our parameter name -> the checkpoint's: the decoder layer's tensors sit directly under
    model.layers.{layer}. (as any decoder layer's), the MTP's own next to them."""
    if name == "embed_tokens":  # a bare Parameter here, a module with a weight in the checkpoint
        name = "embed_tokens.weight"
    return f"model.layers.{layer}." + name.removeprefix("decoder.")


def mtp_family(cfg: ModelConfig) -> type[DeepseekMTP] | type[Qwen3_5MTP]:
    """The MTP layer class of `cfg`'s family: DeepSeek-V3 (MLA) or Qwen3.5 (hybrid, dense or MoE)."""
    if cfg.mla is not None:
        return DeepseekMTP
    if cfg.hybrid is not None:
        return Qwen3_5MTP
    raise ConfigError(f"{cfg.architecture} has no multi-token-prediction layer kvpipe can run")


def load_mtp(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    index: int = 0,
) -> MTPLayer:
    """MTP layer `index` of an HF checkpoint directory (TP 1). Where it has no embed_tokens or
    vocabulary projection of its own the caller calls set_target."""
    if index >= cfg.num_nextn_predict_layers:
        raise ConfigError(
            f"{model_dir}: no multi-token-prediction layer {index} (num_nextn_predict_layers="
            f"{cfg.num_nextn_predict_layers})"
        )
    if gguf_checkpoint(model_dir) is not None:
        raise ConfigError(f"{model_dir}: the MTP layer loads from HF safetensors checkpoints only, not GGUF")
    model_dir = Path(model_dir)
    names = set(weight_files(model_dir))
    family = mtp_family(cfg)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        mtp = family.from_names(cfg, index, names)
    mtp = mtp.to(dtype=torch_dtype).to_empty(device=device)
    keep_fp32(mtp)
    mtp.init_rope(device)
    copy_checkpoint_tensors(mtp, model_dir, names, "the MTP layer")
    if packing_enabled():
        pack_linears(mtp)
    return mtp.eval()
