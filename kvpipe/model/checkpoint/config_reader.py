"""A checkpoint's ModelConfig from its files: an HF directory's config.json, or a GGUF file's
metadata (a .gguf file, or a directory holding one), read as its family says (model/registry.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpipe.config import ConfigError
from kvpipe.model.checkpoint.gguf.checkpoint import gguf_checkpoint
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.registry import model_config


def model_config_of(model_dir: str | Path) -> ModelConfig:
    """The config of the checkpoint at `model_dir` (an HF directory, a .gguf file or a directory
    holding one); ConfigError when it is neither."""
    ckpt = gguf_checkpoint(model_dir)
    if ckpt is not None:
        return model_config(ckpt.config)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (expected a local HF checkpoint directory or a .gguf file)")
    return model_config(json.loads(path.read_text()))
