"""paged_attention against a naive per-row reference: every path (decode batch, causal prefill,
prefill behind a cached prefix), GQA ratios, page sizes, scattered pages and ragged lengths."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.cache.kv_pool import KVPool
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.attention import paged_attention

D = 8


def reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """Row by row with an explicit softmax over the row's whole context (fp64)."""
    out = torch.empty_like(q, dtype=torch.float64)
    g = q.shape[1] // keys[0].shape[1]
    for s, k, v in zip(batch.seqs, keys, values):
        qs = q[s.start : s.start + s.extend_len].double()  # [E, Hq, D]
        k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)  # [L, Hq, D]
        scores = torch.einsum("ehd,lhd->hel", qs, k) * scale
        pos = torch.arange(s.prefix_len, s.total_len)[:, None]
        scores = scores.masked_fill(torch.arange(s.total_len)[None, :] > pos, float("-inf"))
        out[s.start : s.start + s.extend_len] = torch.einsum("hel,lhd->ehd", scores.softmax(-1), v)
    return out


@st.composite
def cases(draw: st.DrawFn) -> dict:
    decode = draw(st.booleans())
    rows = draw(st.integers(1, 5))
    prefixes = [draw(st.integers(0 if not decode else 1, 40)) for _ in range(rows)]
    extends = [1 if decode else draw(st.integers(1, 30)) for _ in range(rows)]
    return {
        "page_size": draw(st.sampled_from([1, 4, 16])),
        "kv_heads": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from([1, 3])),
        "prefixes": prefixes,
        "extends": extends,
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=60, deadline=None)
@given(cases())
def test_paged_attention_matches_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    ps, hkv = case["page_size"], case["kv_heads"]
    hq = hkv * case["group"]
    totals = [p + e for p, e in zip(case["prefixes"], case["extends"])]
    need = sum(-(-t // ps) for t in totals)
    pool = KVPool(1, need + 3, ps, hkv, D)
    perm = torch.randperm(need + 3, generator=gen)  # scattered, non-contiguous page tables
    tables, keys, values, used = [], [], [], 0
    for t, pre in zip(totals, case["prefixes"]):
        n = -(-t // ps)
        tables.append(perm[used : used + n].clone())
        used += n
        keys.append(torch.randn(t, hkv, D, generator=gen))
        values.append(torch.randn(t, hkv, D, generator=gen))
        pos = torch.arange(pre)  # the cached prefix is already in the pool
        pool.write(0, tables[-1][pos // ps], pos % ps, keys[-1][:pre], values[-1][:pre])
    batch = ForwardBatch.build([[0] * e for e in case["extends"]], case["prefixes"], tables, ps)
    # decode: every row adds one token to a context (a fresh 1-token prompt is a prefill row)
    assert (batch.decode is not None) == all(e == 1 and p > 0 for e, p in zip(case["extends"], case["prefixes"]))
    new_k = torch.cat([k[p:] for k, p in zip(keys, case["prefixes"])])
    new_v = torch.cat([v[p:] for v, p in zip(values, case["prefixes"])])
    q = torch.randn(batch.num_tokens, hq, D, generator=gen)
    out = paged_attention(q, new_k, new_v, 0, batch, pool, D**-0.5)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, keys, values, batch, D**-0.5), atol=1e-5, rtol=1e-5)
