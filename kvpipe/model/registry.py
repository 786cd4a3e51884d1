"""The model families kvpipe serves, one Family entry each (declared in model/families/<family>.py
with its model): what the checkpoint schema, the GGUF reader, the loader, the presets and the
drafters ask about a family is read here. A new family is its file plus one entry in FAMILIES.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from kvpipe.config import ConfigError, ParallelConfig
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.families.deepseek_v3 import DEEPSEEK_V3
from kvpipe.model.families.family import Family
from kvpipe.model.families.gemma3 import GEMMA3
from kvpipe.model.families.gpt_oss import GPT_OSS
from kvpipe.model.families.llama import LLAMA, QWEN2, QWEN3
from kvpipe.model.families.minimax_m2 import MINIMAX_M2
from kvpipe.model.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from kvpipe.model.families.qwen3_moe import QWEN3_MOE

# Family.name -> Family (ModelConfig.architecture names one)
FAMILIES: dict[str, Family] = {
    f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, MINIMAX_M2, DEEPSEEK_V3, QWEN3_5, QWEN3_5_MOE, GPT_OSS, GEMMA3)
}


def family(name: str) -> Family:
    """The family ModelConfig.architecture names."""
    if name not in FAMILIES:
        raise ConfigError(f"the {name} model family is not implemented yet; kvpipe serves {tuple(FAMILIES)}")
    return FAMILIES[name]


def build_causal_lm(cfg: ModelConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> LMBase:
    """The family's model for `cfg`, built without loading weights (on the current device)."""
    return family(cfg.architecture).model(cfg, parallel, group)


def hf_family(raw: dict[str, Any]) -> Family:
    """The family of an HF config.json: the first of its `architectures` a family claims."""
    archs = raw.get("architectures") or []
    for arch in archs:
        for f in FAMILIES.values():
            if arch in f.hf_architectures:
                return f
    known = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    model_type = raw.get("model_type")
    unknown = f"the {model_type} model family is not implemented yet; " if model_type else ""
    raise ConfigError(f"unsupported architecture {archs!r}: {unknown}kvpipe supports {known}")


def model_config(raw: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF config.json (or a GGUF file's equivalent), as its family reads it."""
    return ModelConfig.from_hf_dict(raw, hf_family(raw))


def gguf_family(architecture: str) -> Family | None:
    """The family whose GGUF files say general.architecture=`architecture`, None for none."""
    return next((f for f in FAMILIES.values() if f.gguf is not None and f.gguf.architecture == architecture), None)


def gguf_names() -> list[str]:
    """Every general.architecture kvpipe reads GGUF files of."""
    return sorted(f.gguf.architecture for f in FAMILIES.values() if f.gguf is not None)


def eagle_targets() -> tuple[str, ...]:
    """The families an EAGLE(-1/2) Llama head drafts for."""
    return tuple(name for name, f in FAMILIES.items() if f.eagle_target)
