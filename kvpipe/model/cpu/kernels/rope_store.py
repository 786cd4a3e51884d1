"""Python face of rope_store.cpp: RoPE of q and k and the K/V store of one layer in one call."""

from __future__ import annotations

from types import ModuleType

import torch

from kvpipe.model.cpu.kernels.loader import kernels_enabled, load_extra


def rope_store_kernel() -> ModuleType | None:
    """The built extension, built on first use; None when KVPIPE_CPU_KERNELS=0 or the build failed."""
    if not kernels_enabled():
        return None
    return load_extra("rope_store")


def can_rope_store(qkv: torch.Tensor, cos: torch.Tensor, k_pool: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel takes this layer's call: fp32 (or bf16) activations, cos/sin and pool on
    the CPU, full (not partial) rotary dims."""
    return (
        qkv.device.type == "cpu"
        and qkv.dtype in (torch.float32, torch.bfloat16)
        and k_pool.dtype == qkv.dtype
        and cos.dtype == qkv.dtype
        and cos.shape[-1] == head_dim
        and qkv.is_contiguous()
    )
