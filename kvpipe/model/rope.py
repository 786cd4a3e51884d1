"""Rotary position embedding (RoPE), non-interleaved ("rotate_half") as in HF Llama/Qwen.

Supports rope_scaling types `default`, `linear` and `llama3`; the inverse frequencies follow
transformers' `_compute_*_parameters` operation for operation so logits match to fp32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvpipe.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; kvpipe supports {SUPPORTED_ROPE_TYPES}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)  # type: ignore[arg-type]
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths / factor, short untouched, smooth between."""
    try:
        factor = s["factor"]
        low_freq_factor = s["low_freq_factor"]
        high_freq_factor = s["high_freq_factor"]
        old_context_len = s["original_max_position_embeddings"]
    except KeyError as e:
        raise ConfigError(f"llama3 rope_scaling lacks {e.args[0]!r}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 2 * len(inv_freq)] (the rotary dim), in fp32 then cast (as HF does)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R] with R <= D: partial rotary (MiniMax-M2) rotates the first R
    dims of each head and passes the other D - R through."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :r]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., r:]), dim=-1)
