"""Draft models for the STANDALONE drafter's tests (engine/draft_model.py) and MTP layers for the
NEXTN drafter's (engine/mtp_drafter.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvpipe.model.config import ModelConfig


def noisy_copy(src: Path, dst: Path, scale: float = 0.1) -> Path:
    """`src` with seeded noise (scale x each matrix's std) on every weight matrix: a draft that
    agrees with the target often but not always (a part of each chain accepted)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if w.ndim == 2:
            noise = scale * w.float().std() * torch.randn(w.shape, generator=g)
            weights[name] = (w.float() + noise).to(w.dtype)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def bigram_copy(src: Path, dst: Path) -> Path:
    """`src` with every o_proj and down_proj (and a Qwen3.5 delta-net layer's out_proj) zeroed
    (each layer adds nothing to the residual, so the target's next token depends on the last
    token only) and the MTP's input projection (DeepSeek-V3's eh_proj, Qwen3.5's mtp.fc) keeping
    the embedding half (its guess after t_{i+1} is the target's own next token after t_{i+1}):
    an MTP layer that drafts exactly what the target generates."""
    shutil.copytree(src, dst)
    cfg = ModelConfig.from_dir(src)
    weights = load_file(str(dst / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")):
            weights[name] = torch.zeros_like(w)
    h = cfg.hidden_size
    fc = "mtp.fc.weight" if cfg.hybrid is not None else f"model.layers.{cfg.num_layers}.eh_proj.weight"
    weights[fc] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
