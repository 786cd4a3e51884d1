"""Draft models for the STANDALONE drafter's tests (engine/draft_model.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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
