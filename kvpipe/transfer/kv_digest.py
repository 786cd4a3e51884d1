"""End-to-end KV integrity (`--disaggregation-kv-integrity`, off by default; issue 45, finding 10b).

The Mooncake data plane has no credential (Mooncake 0.3.13): anyone who reaches a decode's
transfer port can write into its KV pool, also after a prefill's writes landed and before the
decode reads them. With integrity on, a decode asks each prefill rank for a digest of what it
wrote (TransferRequest.integrity_key: 16 random bytes per room); the prefill rank computes, once
every write of the room landed, a keyed BLAKE2b (16-byte digest) over the bytes of the room's
pages it sent, from its own pool, and sends it in its final TransferStatus (kv_digest), which
the token authenticates; before the request's first decode step the decode computes the same over
its pages and fails that request, and only it, on a mismatch (KVReceiver.poll).

What is hashed, by both sides in the same order: for every full-attention layer of the layout
(sliding-window layers, whose window pages follow another table, are not covered; nor are a draft
model's KV and a hybrid model's recurrent state), each K/V (or latent) buffer, the pages of the
logical pages the decode asked for (from its prefix on), the heads the (prefill rank, decode rank)
pair moves (tp_mapping.slices_for_decode_rank): in a head-major page `[kv_heads, page_size,
head_dim]` those are contiguous. Pages move whole, so the pair's bytes are equal on both sides
when nothing else wrote them. A decode with TP > 1 is not covered yet (rank 0 verifies, and
reads only its own pool).

    digester = KVDigester(pool.buffers(), layout)       # a rank's pool (any device)
    d = digester.digest(key, pages, heads=(h0, h1))     # 16 bytes
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kvpipe.transfer.planning.layout import KVLayout

DIGEST_BYTES = 16
KEY_BYTES = 16


class KVDigester:
    def __init__(self, buffers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        """`buffers`: the rank's pool, layer-major, K then V (KVPool.buffers), each
        [num_pages, kv_heads, page_size, head_dim] (a latent [num_pages, 1, page_size, dim])."""
        if len(buffers) != layout.num_buffers:
            raise ValueError(f"{len(buffers)} buffers for a layout of {layout.num_buffers}")
        swa = set(layout.swa_layers)
        bpl = layout.buffers_per_layer
        self.layout = layout
        covered = [buffers[i] for i in range(len(buffers)) if i // bpl not in swa]
        self._head_nbytes = layout.page_nbytes // layout.kv_heads  # one head of one page: contiguous
        # host memory is hashed where it lies (a page's head range is one contiguous run of its
        # row); device memory is gathered and copied to the host first
        self._host = [b.view(torch.uint8).view(b.shape[0], -1).numpy() for b in covered if b.device.type == "cpu"]
        self._device = [b for b in covered if b.device.type != "cpu"]

    def digest(self, key: bytes, pages: np.ndarray, heads: tuple[int, int]) -> bytes:
        """Keyed BLAKE2b of `pages` (this rank's page ids, in logical order) of every covered
        buffer, global KV heads `heads` (which this rank holds)."""
        lay = self.layout
        h0, h1 = heads[0] - lay.head_start, heads[1] - lay.head_start
        if not 0 <= h0 < h1 <= lay.kv_heads:
            raise ValueError(f"heads {heads} outside this rank's [{lay.head_start}, {lay.head_end})")
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=key)
        ids = [int(p) for p in np.asarray(pages, dtype=np.int64).ravel()]
        a, b = h0 * self._head_nbytes, h1 * self._head_nbytes
        for rows in self._host:
            for p in ids:
                h.update(rows[p, a:b].data)
        for buf in self._device:  # [n, heads, page_size, head_dim] gathered, one copy per buffer
            if ids:
                part = buf.index_select(0, torch.as_tensor(ids, device=buf.device))[:, h0:h1].contiguous()
                h.update(part.view(torch.uint8).cpu().numpy().data)
        return h.digest()
