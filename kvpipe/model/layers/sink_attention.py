"""Prefill attention with attention sinks and/or a sliding window (GPT-OSS), in plain torch.

A sink is a learned logit per query head that joins the softmax denominator and attends to
nothing: out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)). SDPA cannot add it
(nor return its logsumexp), so the scores are computed explicitly with an fp32 softmax, as HF's
eager GPT-OSS attention does. Queries go in blocks so the score tensor stays [Hq, block, keys];
a sliding-window block reads only the keys its rows can see. Models without sinks and windows
never come here (attention.py keeps SDPA for them).
"""

from __future__ import annotations

import torch

# query rows per block: scores of one block are [Hq, QUERY_BLOCK, keys] fp32
QUERY_BLOCK = 512


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sinks: torch.Tensor | None,
    window: int | None,
    key_start: int = 0,
) -> torch.Tensor:
    """q [E, Hq, D] of the tokens at positions prefix_len .. prefix_len + E - 1; k [Hkv, L, D],
    v [Hkv, L, Dv] of the context from position key_start on (L = prefix_len + E - key_start; the
    window must not reach before key_start); sinks [Hq] or None; window: key j is visible to
    query i iff i - window < j <= i (None: causal only) -> [E, Hq, Dv]."""
    e, hq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    out = q.new_empty(e, hq, v.shape[-1])
    sink = None if sinks is None else sinks.float().view(hkv, g, 1, 1)
    for a in range(0, e, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, e)
        hi = prefix_len + b  # keys after the block's last query are never visible
        lo = key_start if window is None else max(key_start, prefix_len + a - window + 1)
        qh = q[a:b].view(b - a, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, e, D]
        ks, vs = k[:, None, lo - key_start : hi - key_start], v[:, None, lo - key_start : hi - key_start]
        scores = torch.matmul(qh, ks.transpose(-1, -2)).float().mul_(scale)  # [Hkv, G, e, l]
        qpos = torch.arange(prefix_len + a, prefix_len + b, device=q.device)[:, None]
        kpos = torch.arange(lo, hi, device=q.device)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores.masked_fill_(~visible, float("-inf"))
        mx = scores.amax(dim=-1, keepdim=True)
        if sink is not None:
            mx = torch.maximum(mx, sink)
        probs = (scores - mx).exp_()
        denom = probs.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + (sink - mx).exp()
        o = torch.matmul((probs / denom).to(v.dtype), vs)  # [Hkv, G, e, Dv]
        out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, hq, -1)
    return out
