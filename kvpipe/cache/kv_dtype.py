"""What a KV pool stores, by --kv-cache-dtype name, and how values go in and out of it.

bf16 / fp16 pools round the model's K and V to nearest. fp8 pools (as SGLang and vLLM) store
x / scale with one scalar scale per layer and K/V (the checkpoint's k_scale / v_scale, else 1.0),
saturated to the format's largest finite value as the hardware conversions do (satfinite: an
out-of-range key becomes +-448, not NaN; an fp16 pool saturates at 65504 likewise); a read
multiplies by the scale again. The transfer
moves the raw bytes and never the scales, so both sides of a PD pair must load the same ones.

fp8 tensors support few torch ops (indexing them came late, and not on every device), so the
pool moves their bytes as uint8 views (`storage_view`) and converts with `.to()` only.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype name -> torch dtype ("auto": the model dtype, resolved by kv_storage_dtype)
KV_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype of --kv-cache-dtype `name` for a model computing in `model_dtype`."""
    if name == "auto":
        return model_dtype
    if name not in KV_TORCH_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose auto or one of {sorted(KV_TORCH_DTYPES)}")
    return KV_TORCH_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor indexing ops accept: fp8 as its uint8 bytes (same shape), anything else itself."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Model-dtype values -> what the pool stores: x / scale (scales are fp8's only), rounded to
    nearest and saturated where the format's range is narrower than the model's (fp8, fp16)."""
    if x.dtype == dtype and scale == 1.0:
        return x
    fmax = torch.finfo(dtype).max
    if not is_fp8(dtype) and fmax >= torch.finfo(x.dtype).max:
        return x.to(dtype)  # bf16 from fp32, fp32 from anything: nothing to saturate
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp(-fmax, fmax).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored values (in the pool's dtype, not its uint8 view) -> `dtype`, times the scale."""
    if x.dtype == torch.uint8:
        raise ValueError("dequantize needs the stored dtype, not raw bytes: view them back first")
    y = x.to(dtype)
    if scale != 1.0:
        y = y * scale
    return y
