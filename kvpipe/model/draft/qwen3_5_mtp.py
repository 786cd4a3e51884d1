"""Qwen3.5's multi-token-prediction (MTP) layer, the NEXTN drafter's model for the hybrid
family (dense and MoE), as the hub checkpoints store it (`mtp_num_hidden_layers`, tensors under
mtp.*) and SGLang runs it (python/sglang/srt/models/qwen3_5_mtp.py; vLLM's qwen3_next_mtp.py):

    x   = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))   [T, 2H] -> [T, H]
    x   = layers.0(x)          a full-attention decoder layer (gated attention; the MoE block in
                               the MoE variant), its own one-layer paged KV
    out = norm(x)              the hidden state the next chain step feeds back
    logits = lm_head(out)      the target's lm_head (and embedding: the checkpoint has no copies)

Every norm is Qwen3.5's zero-centred RMSNorm (scale 1 + weight). h_i is the target's last hidden
state at position i after its final norm, t_{i+1} the token that followed; the MTP runs at
position i (RoPE and KV slot of i), as DeepSeek-V3's does (mtp.py). The layer is full attention
whatever the target's layer pattern (SGLang builds it with full_attention_interval 1), so the
MTP has no recurrent state: its KV is ordinary paged K/V (num_kv_heads x head_dim, one layer),
which the drafter's rollback and PD's draft-KV transfer handle as they do DeepSeek's latent.

transformers' Qwen3.5 models skip the mtp.* tensors when they load (_keys_to_ignore_on_load_unexpected),
so there is no HF reference for this layer; tests/unit/test_model_qwen3_5_mtp.py checks it against
plain torch over the checkpoint's tensors.
"""

from __future__ import annotations

import re

import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.draft.mtp_layer import MTPLayer
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.decoder_layer import DecoderLayer
from kvpipe.model.layers.gated_attention import GatedAttention
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.moe import sparse_or_dense_mlp
from kvpipe.model.layers.norms import ZeroCenteredRMSNorm
from kvpipe.model.registry import family


class Qwen3_5MTP(MTPLayer):
    """MTP layer `index` (mtp.layers.{index}) over a one-layer K/V pool (layer 0 of `pool`)."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        if cfg.hybrid is None:
            raise ConfigError(f"the MTP layer is Qwen3.5's (hybrid); {cfg.architecture} is not")
        super().__init__(cfg, index)
        parallel, h, eps = ParallelConfig(), cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.fc = Linear(2 * h, h)
        # the attention writes layer 0 of the MTP's own pool; the MLP is a layer's of this family
        # (Qwen3.5-MoE: every layer sparse)
        self.decoder = DecoderLayer(
            ZeroCenteredRMSNorm(h, eps),
            GatedAttention(cfg, 0, parallel, None),
            ZeroCenteredRMSNorm(h, eps),
            sparse_or_dense_mlp(cfg, cfg.num_layers + index, parallel, None),
        )
        self.norm = ZeroCenteredRMSNorm(h, eps)
        self._renames = family(cfg.architecture).checkpoint_renames  # Qwen3.5-MoE's shared_expert

    @classmethod
    def from_names(cls, cfg: ModelConfig, index: int, names: set[str]) -> Qwen3_5MTP:
        """The checkpoints share the target's embedding and lm_head (no mtp.* copies)."""
        return cls(cfg, index)

    def tensor_name(self, name: str) -> str:
        """decoder.* sits under mtp.layers.{index}., the MTP's own tensors under mtp."""
        hf = "mtp." + (f"layers.{self.index}." + name.removeprefix("decoder.") if name.startswith("decoder.") else name)
        for pattern, repl in self._renames:
            hf = re.sub(pattern, repl, hf)
        return hf

    def kv_pool(self, num_pages: int, page_size: int, device: str | torch.device) -> KVPool:
        """One full-attention layer's K and V, every KV head (TP 1)."""
        dtype = next(self.parameters()).dtype
        cfg = self.cfg
        return KVPool(1, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device, compute_dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.pre_fc_norm_embedding(self.embed(batch.input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.rope(batch, x)
        out = self.norm(self.decoder(x, cos, sin, batch, pool))
        return out, self.logits(out[batch.logit_indices])
