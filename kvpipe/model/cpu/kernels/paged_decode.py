"""Python face of paged_decode.cpp: decode attention over KV pages read in place."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kvpipe.model.cpu.kernels.loader import kernels_enabled, load_extension


@dataclass(frozen=True)
class PagedDecode:
    """The loaded kernel. Same semantics as attention.attend_pages, computed without a gather."""

    ext: ModuleType

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pages: torch.Tensor,
        lens: torch.Tensor,
        key_start: torch.Tensor,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q [B, Hq, D]; k [N, Hkv, P, D], v [N, Hkv, P, Dv] (one layer's pool, any strides but a
        contiguous last dim: v may be a prefix view of k; float32, bfloat16, float16,
        float8_e4m3fn or float8_e5m2 whatever q's dtype, dequantized row by row as they are read:
        key = stored * k_scale, value = stored * v_scale); pages [B, n] int64 (row b's key i*P+j
        is position key_start[b] + i*P + j); lens, key_start [B] int64; window: each row sees its
        last `window` keys only; sinks [Hq] or None -> [B, Hq, Dv] in q's dtype."""
        return self.ext.paged_decode(q, k, v, pages, lens, key_start, window or 0, sinks, scale, k_scale, v_scale)


def paged_decode_kernel() -> PagedDecode | None:
    """The kernel, built on first use; None when KVPIPE_CPU_KERNELS=0 or the build failed."""
    if not kernels_enabled():
        return None
    ext = load_extension()
    return None if ext is None else PagedDecode(ext)
