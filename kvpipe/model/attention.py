"""Paged attention in plain torch (SDPA). The seam for a GPU kernel is this one function."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpipe.cache.kv_pool import KVPool
from kvpipe.model.forward_batch import ForwardBatch


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    batch: ForwardBatch, pool: KVPool, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (new tokens). Stores k/v in the pool, returns [T, Hq, D].

    Each sequence attends to its prefix in the pool plus its new tokens, causally.
    """
    pool.write(layer, batch.slot_pages, batch.slot_offsets, k, v)
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], pool.kv_heads
    for s in batch.seqs:
        ks, vs = pool.gather(layer, s.page_table, s.total_len)  # [Hkv, L, D]
        qs = q[s.start:s.start + s.extend_len].transpose(0, 1)  # [Hq, E, D]
        if hq != hkv:
            ks = ks.repeat_interleave(hq // hkv, dim=0)
            vs = vs.repeat_interleave(hq // hkv, dim=0)
        # query i (absolute position prefix_len + i) sees keys 0..prefix_len + i
        mask = None
        if s.extend_len > 1:
            qpos = torch.arange(s.prefix_len, s.total_len, device=q.device)[:, None]
            mask = torch.arange(s.total_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[s.start:s.start + s.extend_len] = o.transpose(0, 1)
    return out
