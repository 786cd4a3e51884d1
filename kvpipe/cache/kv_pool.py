"""Paged KV pool: one K and one V tensor per layer, per-page head-major layout.

Layout per layer and per K/V: [num_pages, kv_heads, page_size, head_dim] (see
docs/architecture.md). One page is contiguous, and so is one head range of one page, which
keeps a heterogeneous-TP page transfer to one op per (layer, K/V, page).

An MLA model caches one latent per token instead ([num_pages, 1, page_size, latent_dim], one
"head", the same on every TP rank): the pool then holds one buffer per layer (`latent=True`),
kept in `k`, and `v` is empty.

Sliding-window models (`swa_layers`): the n-th sliding layer and the n-th full layer share one
K and one V tensor (`k[i] is k[j]`). A request's sliding layers use their own page table, whose
pages come from the same allocator as the full layers' (engine/scheduler.py), so the two never write
the same page; sliding layers only hold their window's pages, so sharing halves the memory of
a model that alternates them (GPT-OSS), as vLLM's hybrid allocator does.

Storage dtype (`dtype`, --kv-cache-dtype) and compute dtype (`compute_dtype`, the model's) may
differ: `write` quantizes (cache/kv_dtype.py: fp8 stores x / scale with the layer's k_scale or
v_scale), `gather` and `read_pages` dequantize into the compute dtype; the C++ decode kernel
reads the stored bytes itself (model/cpu/kernels) and takes the scales as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpipe.cache.kv_dtype import dequantize, is_fp8, quantize, storage_view


@dataclass(frozen=True)
class KVBufferInfo:
    """Raw view of one buffer for the transfer layer: base address and sizes in bytes."""

    layer: int
    kind: str  # "k" | "v" | "latent"
    addr: int
    nbytes: int
    page_nbytes: int  # bytes of one page = kv_heads * page_size * head_dim * itemsize
    head_nbytes: int  # bytes of one head within a page = page_size * head_dim * itemsize


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeros of any pool dtype: fp8 as zeroed bytes viewed as fp8 (all-zero bits are +0.0)."""
    if is_fp8(dtype):
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        latent: bool = False,
        swa_layers: tuple[int, ...] = (),
        compute_dtype: torch.dtype | None = None,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what is stored
        self.compute_dtype = compute_dtype or dtype  # what writes bring and reads return
        # per-layer scalar scales of an fp8 pool (stored = value / scale); 1.0 for other dtypes
        self.k_scale = self._scales(k_scales, "k")
        self.v_scale = self._scales(v_scales, "v")
        self.latent = latent
        self.swa_layers = tuple(swa_layers)  # layers that read the sliding-window page tables
        if any(not 0 <= i < num_layers for i in self.swa_layers) or list(self.swa_layers) != sorted(
            set(self.swa_layers)
        ):
            raise ValueError(f"sliding layers {self.swa_layers} are not increasing layers of {num_layers}")
        shape = (num_pages, kv_heads, page_size, head_dim)
        # torch.zeros touches every page now; lazily faulted memory makes the first remote write
        # into it three times slower (measured with Mooncake on a CPU host).
        k = [_zeros(shape, dtype, device) for _ in range(self.num_tensors)]
        v = [] if latent else [_zeros(shape, dtype, device) for _ in range(self.num_tensors)]
        slot = self.tensor_of_layer()
        self.k = [k[slot[i]] for i in range(num_layers)]
        self.v = [v[slot[i]] for i in range(num_layers)] if v else []

    def _scales(self, scales: Sequence[float] | None, kind: str) -> tuple[float, ...]:
        if scales is None:
            return (1.0,) * self.num_layers
        out = tuple(float(x) for x in scales)
        if len(out) != self.num_layers or not all(x > 0 and x != float("inf") for x in out):
            raise ValueError(f"{kind}_scales must be {self.num_layers} positive finite numbers, got {out}")
        if not is_fp8(self.dtype) and any(x != 1.0 for x in out):
            raise ValueError(f"KV scales apply to fp8 pools only, not {self.dtype}")
        return out

    def tensor_of_layer(self) -> list[int]:
        """Layer -> index of its K (and V) tensor: the n-th sliding and the n-th full layer share."""
        swa, seen = set(self.swa_layers), {True: 0, False: 0}
        out = []
        for i in range(self.num_layers):
            out.append(seen[i in swa])
            seen[i in swa] += 1
        return out

    @property
    def num_tensors(self) -> int:
        """K (and V) tensors actually allocated: one per layer, or per sliding/full pair."""
        n_swa = len(self.swa_layers)
        return max(n_swa, self.num_layers - n_swa)

    @property
    def buffers_per_layer(self) -> int:
        return 1 if self.latent else 2

    def layer_buffers(self, layer: int) -> tuple[tuple[str, torch.Tensor], ...]:
        """(kind, tensor) of one layer in transfer order: K then V, or the latent."""
        if self.latent:
            return (("latent", self.k[layer]),)
        return (("k", self.k[layer]), ("v", self.v[layer]))

    def buffers(self) -> list[torch.Tensor]:
        """Every cache tensor, layer-major (the order of buffer_infos and of KVLayout.buffer_addrs)."""
        return [b for layer in range(self.num_layers) for _, b in self.layer_buffers(layer)]

    def write(
        self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """Store new tokens. pages, offsets: [T] int64; k, v: [T, kv_heads, head_dim] (k alone: the latent)."""
        # Advanced indices around a slice put the index dim first: the target view is [T, H, D].
        # fp8 moves as its bytes (uint8 views): not every torch version and device indexes fp8.
        storage_view(self.k[layer])[pages, :, offsets] = storage_view(quantize(k, self.dtype, self.k_scale[layer]))
        if v is not None:
            storage_view(self.v[layer])[pages, :, offsets] = storage_view(quantize(v, self.dtype, self.v_scale[layer]))

    def gather(
        self, layer: int, page_table: torch.Tensor, length: int, first_page: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V of one sequence's tokens [first_page * page_size, length), each [kv_heads,
        length - first_page * page_size, head_dim] (V None: latent)."""
        n = -(-length // self.page_size)
        idx = page_table[first_page:n]
        keep = length - first_page * self.page_size

        def one(buf: torch.Tensor, scale: float) -> torch.Tensor:
            # [n', H, P, D] -> [H, n'*P, D] -> the tokens up to `length`, in the compute dtype
            pages = dequantize(storage_view(buf)[idx].view(buf.dtype), self.compute_dtype, scale)
            return pages.transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim)[:, :keep]

        if self.latent:
            return one(self.k[layer], self.k_scale[layer]), None
        return one(self.k[layer], self.k_scale[layer]), one(self.v[layer], self.v_scale[layer])

    def read_pages(self, layer: int, pages: torch.Tensor, kind: str = "k") -> torch.Tensor:
        """Pages [n] of one layer's K ("k") or V ("v") as [n, kv_heads, page_size, head_dim] in the
        compute dtype (a copy: the torch decode path's gather)."""
        buf, scale = (self.k[layer], self.k_scale[layer]) if kind == "k" else (self.v[layer], self.v_scale[layer])
        raw = storage_view(buf).index_select(0, pages).view(buf.dtype)
        return dequantize(raw, self.compute_dtype, scale)

    def buffer_infos(self) -> list[KVBufferInfo]:
        """Per-(layer, K/V) buffers in a fixed order: layer-major, K before V (or the latent)."""
        item = self.k[0].element_size()
        page_nbytes = self.kv_heads * self.page_size * self.head_dim * item
        out = []
        for layer in range(self.num_layers):
            for kind, buf in self.layer_buffers(layer):
                out.append(
                    KVBufferInfo(
                        layer,
                        kind,
                        buf.data_ptr(),
                        buf.numel() * item,
                        page_nbytes,
                        self.page_size * self.head_dim * item,
                    )
                )
        return out

    @property
    def nbytes(self) -> int:
        """Bytes allocated (a tensor shared by two layers counts once)."""
        return sum({b.addr: b.nbytes for b in self.buffer_infos()}.values())
