"""Rotary position embedding (RoPE): "rotate_half" as in HF Llama/Qwen, and the interleaved-pair
rotation DeepSeek's MLA uses on its rope dims.

Supports rope_scaling types `default`, `linear`, `llama3` and `yarn`; the inverse frequencies (and
yarn's cos/sin multiplier, `attention_factor`) follow transformers' `_compute_*_parameters`
operation for operation so logits match to fp32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvpipe.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _check_type(kind: str) -> None:
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; kvpipe supports {SUPPORTED_ROPE_TYPES}")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None
) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies. max_position_embeddings: yarn's fallback for a
    missing `original_max_position_embeddings` or `factor` (as transformers fills them in)."""
    kind = rope_type(scaling)
    _check_type(kind)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)  # type: ignore[arg-type]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)  # type: ignore[arg-type]
    return inv_freq


def rope_attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int | None = None) -> float:
    """The multiplier of cos and sin: yarn's attention_factor (1.0 for the other types)."""
    kind = rope_type(scaling)
    _check_type(kind)
    if kind != "yarn":
        return 1.0
    s = scaling or {}
    factor, _ = _yarn_lengths(s, max_position_embeddings)
    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:  # DeepSeek: the ratio (1.0 when both are equal, as in V3)
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    return float(attention_factor)


def yarn_get_mscale(scale: float, mscale: float = 1) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1.0 without extension)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_lengths(s: dict[str, Any], max_position_embeddings: int | None) -> tuple[float, int]:
    """(factor, original_max_position_embeddings), defaulted as transformers does."""
    original = s.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise ConfigError("yarn rope_scaling lacks 'original_max_position_embeddings'")
    factor = s.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ConfigError("yarn rope_scaling lacks 'factor'")
        factor = max_position_embeddings / original
    return factor, int(original)


def _yarn_inv_freq(head_dim: int, base: float, s: dict[str, Any], max_position_embeddings: int | None) -> torch.Tensor:
    """YaRN: high frequencies extrapolated, low ones interpolated by 1/factor, a linear ramp between."""
    if float(s.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    dim = head_dim
    factor, original = _yarn_lengths(s, max_position_embeddings)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


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


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 2 * len(inv_freq)] (the rotary dim), in fp32 (scaled by
    yarn's attention_factor) then cast, as HF does."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


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


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with rotary pairs (x0, x1), (x2, x3), ...; cos, sin: [T, D] as rope_cos_sin gives.

    Returns the rotated pairs de-interleaved, [evens | odds], as HF's
    apply_rotary_pos_emb_interleave does: q and k are permuted alike, so q.k is unchanged, and the
    MLA cache stores k_rope in this order.
    """
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]  # cos/sin are cat(freqs, freqs): one angle per pair
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
