"""Paged attention in plain torch. The seam for a GPU kernel is `paged_attention`.

Three shapes of work, picked per forward from the ForwardBatch (a step is all decode rows, or
prefill rows; with --enable-mixed-chunk a prefill step also carries decode rows after its prompt
rows, ForwardBatch.decode_tail, which take the decode pass below, bit for bit a decode step's;
MLA and layers with sinks or a window take them as prefill rows of one token):
- decode (every row adds one token): one pass for the whole batch over its pages (DecodeIndex), no
  per-row Python work. On CPU the C++ kernel (cpu/kernels/paged_decode.cpp) reads the pages in
  place; elsewhere, or without the kernel, they are gathered once per layer with one
  `index_select` per K/V (dequantized into the model dtype: KVPool.read_pages) and
  `attend_pages` (the reference semantics) runs on the copy;
- prefill of a row with nothing cached: causal SDPA straight on the new K/V (no gather, no
  materialised mask; torch's CPU flash kernel skips the masked half);
- prefill of a row behind a cached prefix (a later chunk, a prefix-cache hit): SDPA over the
  row's gathered pages with a lower-right causal mask [E, L].
Prefill rows are looped in Python: each is one large SDPA call, so the loop costs nothing next
to it. 4-D views are passed on purpose: SDPA takes its flash kernel for them (3-D inputs fall
back to the math path, 5x slower at 2K tokens), and GQA goes through `enable_gqa` rather than
copies of the KV heads. MLA (mla.py) reuses the three kernels on its own keys and values.

GPT-OSS layers pass attention sinks and (sliding layers) a window: prefill rows then go through
sink_attention.window_attention (explicit fp32 softmax; SDPA cannot add a sink), decode through
`attend_pages` with the sink in the denominator and the keys outside the window masked. A
sliding layer reads its own page tables (`ForwardBatch.swa`, when the engine keeps window pages
only) and touches only the pages from the one its window starts in: the pages before may be freed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.window_pages import window_first_page
from kvpipe.model.cpu.kernels import paged_decode_kernel
from kvpipe.model.forward_batch import DecodeIndex, ForwardBatch, SeqSpan
from kvpipe.model.layers.sink_attention import window_attention


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    batch: ForwardBatch,
    pool: KVPool,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    stored: bool = False,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (new tokens). Stores k/v in the pool (unless `stored`: the
    caller did, cpu/kernels/rope_store.cpp), returns [T, Hq, D].

    Each sequence attends to its prefix in the pool plus its new tokens, causally; with a
    window, query i sees keys j with i - window < j <= i; sinks [Hq] join each softmax.
    """
    stored_hook = batch.kv_stored  # the full batch's (a sliding layer's view below has none)
    if window is not None and batch.swa is not None:  # a sliding layer's own pages
        batch = batch.swa
    if not stored:
        pool.write(layer, batch.slot_pages, batch.slot_offsets, k, v)
    if stored_hook is not None:
        stored_hook(layer)
    if batch.decode is not None:
        return decode_attention(q, layer, batch.decode, pool, scale, sinks, window)
    if sinks is not None or window is not None:
        return _window_prefill(q, k, v, layer, batch, pool, scale, sinks, window)
    if len(batch.seqs) == 1 and batch.seqs[0].prefix_len == 0:  # the common whole-prompt prefill
        return causal_attention(q, k, v, scale)
    out = torch.empty_like(q)
    seqs = batch.seqs
    if batch.decode_tail is not None:  # a MIXED step: its decode rows (the last ones) in one pass
        seqs = seqs[: len(seqs) - batch.decode_tail.batch_size]
        d0 = seqs[-1].start + seqs[-1].extend_len
        out[d0:] = decode_attention(q[d0:], layer, batch.decode_tail, pool, scale)
    for s in seqs:
        rows = slice(s.start, s.start + s.extend_len)
        if s.prefix_len == 0:
            out[rows] = causal_attention(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = _extend(q[rows], layer, s, pool, scale)
    return out


def _window_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    batch: ForwardBatch,
    pool: KVPool,
    scale: float,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """The prefill rows of a layer with sinks and/or a window: a row with nothing cached attends
    to its new k/v directly, any other to its gathered pages."""
    out = torch.empty_like(q)
    for s in batch.seqs:
        rows = slice(s.start, s.start + s.extend_len)
        first = 0
        if s.prefix_len == 0:
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, E, D]
        else:  # from the first page the row's first query still sees, new tokens included
            first = 0 if window is None else window_first_page(s.prefix_len, window, pool.page_size)
            ks, vs = _gather_kv(pool, layer, s, first)  # [Hkv, L - first * P, D]
        out[rows] = window_attention(q[rows], ks, vs, s.prefix_len, scale, sinks, window, first * pool.page_size)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row, no cache: q [E, Hq, D], k [E, Hkv, D], v [E, Hkv, Dv] -> [E, Hq, Dv]."""
    o = F.scaled_dot_product_attention(
        q[None].transpose(1, 2),
        k[None].transpose(1, 2),
        v[None].transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, E, D]
    return o[0].transpose(0, 1)


def _extend(q: torch.Tensor, layer: int, s: SeqSpan, pool: KVPool, scale: float) -> torch.Tensor:
    """One row behind a cached prefix: q [E, Hq, D] -> [E, Hq, D] over the row's L = total_len keys."""
    ks, vs = _gather_kv(pool, layer, s)  # [Hkv, L, D], new tokens included
    return prefix_attention(q, ks, vs, s.prefix_len, scale)


def _gather_kv(pool: KVPool, layer: int, s: SeqSpan, first_page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one row's tokens from `first_page` on; a K/V pool (not MLA's latent one) has both."""
    ks, vs = pool.gather(layer, s.page_table, s.total_len, first_page)
    if vs is None:
        raise ValueError("paged_attention needs a K/V pool, not a latent one")
    return ks, vs


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float) -> torch.Tensor:
    """q [E, Hq, D] of the tokens after prefix_len; k [Hkv, L, D], v [Hkv, L, Dv] of the whole
    context (L = prefix_len + E) -> [E, Hq, Dv]."""
    total = k.shape[1]
    # query i sits at absolute position prefix_len + i and sees keys 0 .. prefix_len + i
    qpos = torch.arange(prefix_len, total, device=q.device)[:, None]
    mask = torch.arange(total, device=q.device)[None, :] <= qpos  # [E, L]
    o = F.scaled_dot_product_attention(
        q[None].transpose(1, 2), k[None], v[None], attn_mask=mask[None, None], scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    layer: int,
    index: DecodeIndex,
    pool: KVPool,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Every row adds one token: q [B, Hq, D] -> [B, Hq, D], one pass over the batch's pages.

    A sliding layer masks the keys before its window (its index, ForwardBatch.swa's, starts at
    the page the window starts in).
    """
    kernel = paged_decode_kernel() if q.device.type == "cpu" else None
    if kernel is not None:  # reads the pages in place (any pool dtype): no gather, no per-tile matmuls
        return kernel(
            q,
            pool.k[layer],
            pool.v[layer],
            index.page_table,
            index.lens,
            index.key_start,
            scale,
            window,
            sinks,
            pool.k_scale[layer],
            pool.v_scale[layer],
        )
    b, n, page = index.batch_size, index.num_pages, pool.page_size
    hkv, d = pool.kv_heads, pool.head_dim
    kp = pool.read_pages(layer, index.pages, "k").view(b, n, hkv, page, d)  # dequantized copies
    vp = pool.read_pages(layer, index.pages, "v").view(b, n, hkv, page, d)
    return attend_pages(q, kp, vp, index.valid if window is None else index.window_valid(window), scale, sinks)


def attend_pages(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row over gathered pages: q [B, Hq, D], kp [B, n, Hkv, P, D], vp [B, n, Hkv, P, Dv],
    valid [B, n, 1, 1, P], sinks [Hq] or None -> [B, Hq, Dv].

    The pages keep the pool's layout and the scores stay per page, [B, n, Hkv, G, P] (G query
    heads per KV head): a batched matmul reads each page in place, so nothing is transposed into a
    [B, Hkv, L, D] copy. The softmax runs over (n, P) together.
    """
    b, _, hkv, _, d = kp.shape
    g = q.shape[1] // hkv
    scores = torch.matmul(q.view(b, 1, hkv, g, d), kp.transpose(-1, -2)).float()  # [B, n, Hkv, G, P]
    scores.mul_(scale).masked_fill_(~valid, float("-inf"))
    mx = scores.amax(dim=(1, 4), keepdim=True)  # [B, 1, Hkv, G, 1]
    if sinks is not None:  # the sink joins the max and the denominator, and adds no value
        sink = sinks.float().view(1, 1, hkv, g, 1)
        mx = torch.maximum(mx, sink)
    probs = (scores - mx).exp_()
    denom = probs.sum(dim=(1, 4))  # [B, Hkv, G]
    if sinks is not None:
        denom = denom + (sink - mx).exp_().view(b, hkv, g)
    o = torch.matmul(probs.to(vp.dtype), vp).sum(1)  # [B, Hkv, G, Dv]
    return (o / denom[..., None].to(o.dtype)).view(b, hkv * g, vp.shape[-1])
