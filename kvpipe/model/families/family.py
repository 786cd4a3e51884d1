"""Family: everything kvpipe knows of one model family, declared next to its model in
model/families/<family>.py and collected by model/registry.py. Nothing outside those files names
a family's HF or GGUF architecture: the checkpoint schema, the GGUF reader, the loader, the
presets and the drafters ask the registry.

A family's part of turning a raw HF config.json into a ModelConfig is `config`: it returns the
ModelConfig fields the family sets beyond the ones every family reads alike (sizes, norms, RoPE,
special ids; checkpoint/schema.py), e.g. its MoEConfig, MLAConfig or HybridConfig, q/k norms,
sliding-window layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from kvpipe.config import ParallelConfig
from kvpipe.model.checkpoint.gguf.family import GGUFFamily
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.families.causal_lm import LMBase

# (cfg, parallel, TP group) -> the family's model, built without loading weights
ModelBuilder = Callable[[ModelConfig, ParallelConfig, dist.ProcessGroup | None], LMBase]
# raw HF config.json -> the ModelConfig fields the family sets (keyword arguments of ModelConfig)
ConfigFields = Callable[[dict[str, Any]], dict[str, Any]]
# raw HF config.json, its parsed ModelConfig -> None, or ConfigError for an option the model lacks
ConfigCheck = Callable[[dict[str, Any], ModelConfig], None]


def no_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {}


def no_check(raw: dict[str, Any], cfg: ModelConfig) -> None:
    pass


def qk_normed(raw: dict[str, Any]) -> dict[str, Any]:
    """A per-head RMSNorm on q and k before RoPE (Qwen3 and the families built on it)."""
    return {"qk_norm": True}


@dataclass(frozen=True, eq=False)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # entries of config.json's `architectures` that name it
    model_type: str  # config.json's `model_type` (the presets and GGUF configs write it)
    model: ModelBuilder
    config: ConfigFields = no_fields
    check: ConfigCheck = no_check  # options of the family's HF config the model does not implement
    # (pattern, replacement) pairs, in order, from our parameter names to the checkpoint's (loader.hf_name)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # RoPE may turn only part of each head: `rotary_dim` / `partial_rotary_factor` set
    # ModelConfig.rotary_dim (schema.py); any other family refuses partial_rotary_factor != 1 (loader.py)
    partial_rotary: bool = False
    gguf: GGUFFamily | None = None  # llama.cpp's names for it; None: no GGUF files
    activations: tuple[str, ...] = ("silu",)  # ModelConfig.hidden_act values its MLPs compute (mlp.ACTIVATIONS)
    eagle_target: bool = False  # an EAGLE(-1/2) Llama head drafts from its hidden states (draft/eagle.py)

    def hf_header(self) -> dict[str, Any]:
        """The keys of an HF config.json that name this family."""
        return {"architectures": list(self.hf_architectures), "model_type": self.model_type}
