"""The model class of a ModelConfig's family, built without loading weights."""

from __future__ import annotations

import torch.distributed as dist

from kvpipe.config import ParallelConfig
from kvpipe.model.config import ModelConfig
from kvpipe.model.llama import CausalLM, LMBase


def build_causal_lm(cfg: ModelConfig, parallel: ParallelConfig, group: dist.ProcessGroup | None) -> LMBase:
    """A hybrid (linear + full attention) model for Qwen3.5, the Llama/Qwen CausalLM otherwise."""
    if cfg.hybrid is not None:
        from kvpipe.model.qwen3_5 import Qwen3_5CausalLM

        return Qwen3_5CausalLM(cfg, parallel, group)
    return CausalLM(cfg, parallel, group)
