"""KV pool pages as bytes and back: what the KV tier (cache/store_tier.py) stores per page.

A page's payload is that page of every K/V (or latent) buffer, layer-major, as raw stored bytes
(an fp8 pool's bytes stay fp8: the scales are the checkpoint's, the same on every server of one
model, and part of nothing stored). Each buffer is [num_pages, kv_heads, page_size, head_dim]
(cache/kv_pool.py), so one page of one buffer is contiguous: kv_heads * page_size * head_dim *
itemsize bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvpipe.cache.kv_pool import KVPool


class PoolPages:
    def __init__(self, pool: KVPool) -> None:
        bufs = pool.buffers()
        if len({b.data_ptr() for b in bufs}) != len(bufs):
            raise ValueError("the KV tier stores pools whose layers own their buffers (no sliding-window sharing)")
        # uint8 views: [num_pages, kv_heads, page_size, head_dim * itemsize]
        self.buffers = [b.view(torch.uint8) for b in bufs]
        self.buffer_bytes = [int(b[0].numel()) for b in self.buffers]
        self.payload_bytes = sum(self.buffer_bytes)
        # a host pool is copied through numpy views of the same memory: torch's uint8 index_select
        # and index_put took 10-50x longer for the same bytes on the loaded 2-core machine (its
        # intra-op threads fight the engine's), numpy's copies run in this thread
        self._host = [b.numpy() for b in self.buffers] if all(b.device.type == "cpu" for b in self.buffers) else None

    def read(self, pages: np.ndarray) -> list[memoryview]:
        """A copy of each page's payload (the pool's pages may be reused once this returns): views
        of rows of one fresh [n, payload_bytes] array, so a finished request's pages cost the engine
        two memory copies, not a Python object per byte range."""
        if len(pages) == 0:
            return []
        if self._host is not None:
            idx_np = np.asarray(pages, dtype=np.int64)
            out = np.empty((len(idx_np), self.payload_bytes), dtype=np.uint8)  # [n, payload_bytes]
            at = 0
            for host, width in zip(self._host, self.buffer_bytes):
                out[:, at : at + width] = host[idx_np].reshape(len(idx_np), width)
                at += width
            return [memoryview(out[i]) for i in range(len(idx_np))]
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        rows = torch.cat([b.index_select(0, idx).reshape(len(idx), -1) for b in self.buffers], dim=1)
        arr = rows.cpu().numpy()  # [n, payload_bytes], owned by these views from now on
        return [memoryview(arr[i]) for i in range(len(idx))]

    def write(self, pages: np.ndarray, payloads: Sequence[bytes | memoryview]) -> None:
        """Load payloads (each payload_bytes long) into pool pages `pages`."""
        n = len(pages)
        if n == 0:
            return
        if n != len(payloads) or any(len(p) != self.payload_bytes for p in payloads):
            raise ValueError(f"{len(payloads)} payloads for {n} pages of {self.payload_bytes} bytes")
        if self._host is not None:
            flat = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(n, self.payload_bytes)
            idx_np = np.asarray(pages, dtype=np.int64)
            at = 0
            for host, width in zip(self._host, self.buffer_bytes):
                host[idx_np] = flat[:, at : at + width].reshape(n, *host.shape[1:])
                at += width
            return
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).reshape(n, self.payload_bytes)
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        at = 0
        for buf, width in zip(self.buffers, self.buffer_bytes):
            buf[idx] = data[:, at : at + width].reshape(n, *buf.shape[1:]).to(buf.device)
            at += width
