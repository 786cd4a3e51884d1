"""An EAGLE(-1/2) draft head for a Llama-family target (SGLang's LlamaForCausalLMEagle,
python/sglang/srt/models/llama_eagle.py, run by its EAGLE worker), the drafter of
`--speculative-algorithm EAGLE --speculative-draft-model-path <head>`:

    x      = fc(cat(embed(t_{i+1}), h_i))        [T, 2 hidden] -> [T, hidden] (fc may carry a bias)
    x      = x + self_attn(x)                     no input_layernorm (EAGLE drops layer 0's)
    out    = x + mlp(post_attention_layernorm(x)) the hidden state the next chain step feeds
    logits = lm_head(out)                         the target's lm_head, no final norm

h_i is the target's last hidden state at position i AFTER its final norm: SGLang's LlamaModel
returns it normed and its LogitsProcessor stores that tensor for EAGLE(-1/2) drafting (EAGLE-3
takes auxiliary layers instead; not this head), as the original EAGLE code feeds HF LlamaModel's
output. The head's output goes to the lm_head as it is: SGLang's EAGLE LlamaModel returns
`hidden_states + residual`, no norm. So EAGLE consumes exactly what NEXTN does (ModelRunner's
capture_hidden) at the same positions (row i from h_i and t_{i+1}, at i), and the NEXTN drafter
(engine/spec/mtp_drafter.py) runs it with its own one-layer KV (engine/spec/eagle_drafter.py): EagleHead has
the MTP layers' interface (forward(hidden, batch, pool) -> (out, logits), set_target, kv_pool,
embed, logits, init_rope).

Checkpoint: an HF-style directory, config.json with architectures ["LlamaForCausalLMEagle"], one
layer of the target's hidden size and vocabulary, safetensors with `fc.weight` (`fc.bias`),
`layers.0.*` and optionally `embed_tokens.weight` (names with a `model.` prefix are read too).
The embedding is the checkpoint's copy when it has one, else the target's; the vocabulary
projection is always the target's (SGLang's load_weights skips `lm_head` and its worker shares
the target's embedding and lm_head; EAGLE trains both frozen at the target's values, so the two
agree for published heads). A `layers.0.input_layernorm.weight` in the checkpoint is not read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.loader import pack_linears, resolve_dtype, weight_files
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.cpu.fused_projections import fuse_projections, fusing_enabled
from kvpipe.model.cpu.packed_linear import packing_enabled
from kvpipe.model.draft.mtp_layer import MTPLayer, copy_checkpoint_tensors
from kvpipe.model.families.llama import EAGLE_HEAD_ARCHITECTURE, LLAMA
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.decoder_layer import DecoderLayer
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.mlp import MLP
from kvpipe.model.layers.norms import RMSNorm
from kvpipe.model.registry import eagle_targets, family, model_config


def eagle_config(head_dir: str | Path) -> ModelConfig:
    """The head's config.json as a one-layer Llama config; ConfigError when it is not an EAGLE head."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{head_dir}: no config.json (an EAGLE head is an HF-style checkpoint directory)")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    if EAGLE_HEAD_ARCHITECTURE not in archs:
        raise ConfigError(f"{head_dir}: architectures {archs!r} is not an EAGLE head ({EAGLE_HEAD_ARCHITECTURE!r})")
    cfg = model_config({**raw, "architectures": list(LLAMA.hf_architectures)})
    if cfg.num_layers != 1:
        raise ConfigError(f"{head_dir}: an EAGLE head has one decoder layer, this one {cfg.num_layers}")
    return cfg


def check_eagle_head(head: ModelConfig, target: ModelConfig, head_dir: str | Path) -> None:
    """Refuse a head that cannot draft for `target`: another hidden size or vocabulary, a target
    family it was not made for."""
    if not family(target.architecture).eagle_target:
        raise ConfigError(
            f"--speculative-algorithm EAGLE with a draft head drafts for Llama-family targets "
            f"{eagle_targets()}; the target is {target.architecture}"
        )
    for what in ("hidden_size", "vocab_size"):
        if getattr(head, what) != getattr(target, what):
            raise ConfigError(
                f"--speculative-draft-model-path {head_dir}: the EAGLE head's {what} {getattr(head, what)} "
                f"is not the target's ({getattr(target, what)})"
            )


class EagleHead(MTPLayer):
    """One EAGLE decoder layer over a one-layer GQA KV pool (layer 0 of `pool`, kv_pool). What it
    shares with the MTP layers (the target's embedding and lm_head, RoPE) is MTPLayer's."""

    def __init__(self, cfg: ModelConfig, own_embed: bool, fc_bias: bool, names: frozenset[str] = frozenset()) -> None:
        super().__init__(cfg, 0, own_embed)
        parallel = ParallelConfig()
        h = cfg.hidden_size
        self.checkpoint_names = names  # the checkpoint's tensor names (tensor_name: with or without `model.`)
        self.fc = Linear(2 * h, h, fc_bias)
        # the checkpoint's layers.0 (its input_layernorm dropped: EAGLE feeds fc's output as it is)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(
                    nn.Identity(),
                    GQAttention(cfg, 0, parallel, None),
                    RMSNorm(h, cfg.rms_norm_eps),
                    MLP(h, cfg.intermediate_size, parallel, None),
                )
            ]
        )

    def tensor_name(self, name: str) -> str:
        return eagle_tensor_name(name, set(self.checkpoint_names))

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (a norm's weight: never packed or quantized)."""
        layer = cast(DecoderLayer, self.layers[0])
        return cast(RMSNorm, layer.post_attention_layernorm).weight.dtype

    def kv_pool(self, num_pages: int, page_size: int, device: str | torch.device) -> KVPool:
        """The head's one-layer KV pool (its KV heads whole, TP 1), in its compute dtype."""
        cfg, dtype = self.cfg, self.dtype
        return KVPool(1, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device, compute_dtype=dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden]: h_i of each packed row (batch.input_ids holds t_{i+1}, its positions
        are i). Writes the T K/V rows into layer 0 of `pool`. Returns (out [T, hidden], fp32
        logits [B_out, V] of the rows in batch.logit_indices), the logits through the target's
        lm_head with no norm."""
        x = self.fc(torch.cat([self.embed(batch.input_ids), hidden.to(self.dtype)], dim=-1))
        cos, sin = self.rope(batch, x)
        out = self.layers[0](x, cos, sin, batch, pool)
        return out, self.logits(out[batch.logit_indices])


def eagle_tensor_name(name: str, names: set[str]) -> str:
    """Our parameter name -> the checkpoint's: as it is (SGLang's EAGLE checkpoints), or under
    `model.` where the checkpoint has that."""
    if name == "embed_tokens":  # a bare Parameter here, a module with a weight in the checkpoint
        name = "embed_tokens.weight"
    return name if name in names or "model." + name not in names else "model." + name


def load_eagle(
    head_dir: str | Path,
    target: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> EagleHead:
    """The EAGLE head of an HF-style directory (TP 1), checked against the target's config; the
    caller calls set_target."""
    head_dir = Path(head_dir)
    cfg = eagle_config(head_dir)
    check_eagle_head(cfg, target, head_dir)
    names = set(weight_files(head_dir))
    own_embed = eagle_tensor_name("embed_tokens", names) in names
    fc_bias = eagle_tensor_name("fc.bias", names) in names
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        head = EagleHead(cfg, own_embed, fc_bias, frozenset(names))
    head = head.to(dtype=torch_dtype).to_empty(device=device)
    head.init_rope(device)
    copy_checkpoint_tensors(head, head_dir, names, "the EAGLE head")
    if fusing_enabled() and torch.device(device).type == "cpu":
        fuse_projections(head)  # q/k/v, gate/up: as load_model does for the target
    if packing_enabled():
        pack_linears(head)
    return head.eval()
