"""What every family's multi-token-prediction (MTP) layer shares: the NEXTN drafter's model
(engine/spec/mtp_drafter.py), one decoder layer with its own one-layer paged KV pool that turns the
target's last hidden state h_i and the token t_{i+1} that followed into a guess at t_{i+2}.

A family (mtp.py: DeepSeek-V3; qwen3_5_mtp.py: Qwen3.5) says how h_i and the token's embedding
are combined, which decoder layer runs, what KV pool it writes and what its tensors are called
in the checkpoint. What they share is here: the target's embedding and lm_head where the
checkpoint has no copy of its own (SGLang always shares the target's), and RoPE as the target's.
Every family's forward has the same contract:

    forward(hidden [T, H], batch, pool) -> (out [T, H], fp32 logits [B_out, V])

batch.input_ids holds t_{i+1} at positions i, `hidden` the h_i of each row (after the target's
final norm); `out` is the hidden state a chained step feeds back as its h, the logits are those of
the rows in batch.logit_indices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.loader import _slices
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq


class MTPLayer(nn.Module, ABC):
    """One MTP layer of `cfg`'s checkpoint (its `index`-th), over a one-layer KV pool (kv_pool)."""

    def __init__(self, cfg: ModelConfig, index: int, own_embed: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index
        h = cfg.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, h), requires_grad=False) if own_embed else None
        # the target's embedding [V, hidden] and vocabulary projection, where the checkpoint has no
        # copy (set_target; plain attributes, not submodules: the target owns them)
        self.target_embed: torch.Tensor | None = None
        self.target_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.init_rope()

    @abstractmethod
    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden]: the h_i of each packed row (batch.input_ids holds t_{i+1}, its
        positions are i). Writes the T rows' KV into layer 0 of `pool`. Returns (out [T, hidden],
        fp32 logits [B_out, V] of the rows in batch.logit_indices)."""

    @abstractmethod
    def tensor_name(self, name: str) -> str:
        """Our parameter name -> the checkpoint's tensor name."""

    @abstractmethod
    def kv_pool(self, num_pages: int, page_size: int, device: str | torch.device) -> KVPool:
        """The one-layer KV pool this layer's attention writes (in its compute dtype)."""

    @property
    def own_head(self) -> nn.Module | None:
        """The checkpoint's own vocabulary projection of this layer (None: the target's)."""
        return None

    def set_target(self, embed: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's embedding table and its lm_head (hidden -> vocab, no norm), used where this
        layer has no copy of its own."""
        self.target_embed = embed
        self.target_head = head

    def init_rope(self, device: str | torch.device | None = None) -> None:
        """RoPE as the target's (LMBase.init_rope): fp32 inverse frequencies and yarn's factor."""
        cfg = self.cfg
        self.inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        if device is not None:
            self.inv_freq = self.inv_freq.to(device)
        self.rope_attention_factor = rope_attention_factor(cfg.rope_scaling, cfg.max_position_embeddings)

    def rope(self, batch: ForwardBatch, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim] of the batch's positions, in `like`'s dtype and device."""
        return rope_cos_sin(self.inv_freq.to(like.device), batch.positions, like.dtype, self.rope_attention_factor)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self.target_embed
        assert table is not None, "an MTP layer without its own embedding needs the target's"
        return F.embedding(token_ids, table)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[B, hidden] normed output rows -> [B, V] fp32."""
        head = self.own_head
        if head is not None:
            return head(out).float()
        assert self.target_head is not None, "an MTP layer without its own head needs the target's"
        return self.target_head(out).float()


def copy_checkpoint_tensors(layer: MTPLayer, ckpt_dir: Path, names: set[str], what: str) -> None:
    """Every parameter of `layer` (materialized, on its device) from its checkpoint tensor
    (`layer.tensor_name`) among `names`, the tensors of `ckpt_dir`; a missing tensor or another
    shape is a ConfigError naming `what` ("the MTP layer", "the EAGLE head")."""
    params = dict(layer.named_parameters())
    plan = {n: layer.tensor_name(n) for n in params}
    missing = sorted(hf for hf in plan.values() if hf not in names)
    if missing:
        raise ConfigError(f"{ckpt_dir}: {what} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    with _slices(ckpt_dir, None) as get_slice, torch.no_grad():
        for name, hf in plan.items():
            t = get_slice(hf)[:]
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"{ckpt_dir}: tensor {hf} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.copy_(t)
