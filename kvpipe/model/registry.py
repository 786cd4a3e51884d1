"""The model families kvpipe serves: for each, the class that builds it, what its HF config.json
says it is (`architectures`, `model_type`), and what the loader needs to know of it (options it
refuses, checkpoint names that differ from our module tree).

model/checkpoint/schema.py recognises a checkpoint's family from its HF `architectures` list
(SUPPORTED_ARCHITECTURES, the family's name in ModelConfig.architecture); this module maps that
family to its model. A new family is one file that assembles the building blocks, one entry in
SUPPORTED_ARCHITECTURES and one in FAMILIES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import SUPPORTED_ARCHITECTURES, ModelConfig
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.families.deepseek_v3 import DeepseekV3CausalLM, check_deepseek_v3
from kvpipe.model.families.gpt_oss import GptOssCausalLM
from kvpipe.model.families.llama import LlamaCausalLM
from kvpipe.model.families.minimax_m2 import CHECKPOINT_RENAMES as MINIMAX_M2_RENAMES
from kvpipe.model.families.minimax_m2 import MiniMaxM2CausalLM, check_minimax_m2
from kvpipe.model.families.qwen3_5 import MOE_CHECKPOINT_RENAMES as QWEN3_5_MOE_RENAMES
from kvpipe.model.families.qwen3_5 import Qwen3_5CausalLM, check_qwen3_5_moe
from kvpipe.model.families.qwen3_moe import Qwen3MoeCausalLM, check_qwen3_moe

# raw HF config.json, its parsed ModelConfig -> None, or ConfigError for an option the model lacks
ConfigCheck = Callable[[dict[str, Any], ModelConfig], None]


def _no_check(raw: dict[str, Any], cfg: ModelConfig) -> None:
    pass


@dataclass(frozen=True)
class Family:
    model: Callable[[ModelConfig, ParallelConfig, dist.ProcessGroup | None], LMBase]
    model_type: str  # HF config.json's `model_type` (the presets write it)
    check: ConfigCheck = _no_check  # options of the family's HF config the model does not implement
    # (pattern, replacement) pairs, in order, from our parameter names to the checkpoint's (loader.hf_name)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    partial_rotary: bool = False  # RoPE may turn only part of each head (ModelConfig.rotary_dim)


FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaCausalLM, "llama"),
    "qwen2": Family(LlamaCausalLM, "qwen2"),
    "qwen3": Family(LlamaCausalLM, "qwen3"),
    "qwen3_moe": Family(Qwen3MoeCausalLM, "qwen3_moe", check_qwen3_moe),
    "minimax_m2": Family(MiniMaxM2CausalLM, "minimax_m2", check_minimax_m2, MINIMAX_M2_RENAMES, partial_rotary=True),
    "deepseek_v3": Family(DeepseekV3CausalLM, "deepseek_v3", check_deepseek_v3),
    "qwen3_5": Family(Qwen3_5CausalLM, "qwen3_5_text", partial_rotary=True),
    "qwen3_5_moe": Family(
        Qwen3_5CausalLM, "qwen3_5_moe_text", check_qwen3_5_moe, QWEN3_5_MOE_RENAMES, partial_rotary=True
    ),
    "gpt_oss": Family(GptOssCausalLM, "gpt_oss"),
}


def family(name: str) -> Family:
    """The family ModelConfig.architecture names; ConfigError where config.py recognises it but
    no model implements it."""
    if name not in FAMILIES:
        raise ConfigError(f"the {name} model family is not implemented yet; kvpipe serves {tuple(FAMILIES)}")
    return FAMILIES[name]


def build_causal_lm(cfg: ModelConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> LMBase:
    """The family's model for `cfg`, built without loading weights (on the current device)."""
    return family(cfg.architecture).model(cfg, parallel, group)


def hf_header(name: str) -> dict[str, Any]:
    """The keys of an HF config.json that name family `name`: its `architectures` list and
    `model_type`."""
    archs = [hf for hf, fam in SUPPORTED_ARCHITECTURES.items() if fam == name]
    return {"architectures": archs, "model_type": family(name).model_type}
