"""paged_attention against a naive per-row reference: every path (decode batch, causal prefill,
prefill behind a cached prefix, a MIXED step's prompt rows then decode rows), GQA ratios, page
sizes, scattered pages and ragged lengths."""

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
    """Rows of a step: all prefill, all decode, or (a MIXED step) prefill rows then decode rows."""
    mode = draw(st.sampled_from(["prefill", "decode", "mixed"]))
    prompts = 0 if mode == "decode" else draw(st.integers(1, 4))
    decodes = {"prefill": 0, "decode": draw(st.integers(1, 5)), "mixed": draw(st.integers(1, 4))}[mode]
    prefixes = [draw(st.integers(0, 40)) for _ in range(prompts)] + [draw(st.integers(1, 40)) for _ in range(decodes)]
    extends = [draw(st.integers(1, 30)) for _ in range(prompts)] + [1] * decodes
    return {
        "page_size": draw(st.sampled_from([1, 4, 16])),
        "kv_heads": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from([1, 3])),
        "prefixes": prefixes,
        "extends": extends,
        "seed": draw(st.integers(0, 2**16)),
    }


def _is_decode(prefix: int, extend: int) -> bool:
    return extend == 1 and prefix > 0


def _setup(case: dict) -> tuple[KVPool, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Generator]:
    """A pool holding every row's cached prefix at scattered pages: (pool, page tables, each row's
    keys and values [total, Hkv, D], the generator)."""
    gen = torch.Generator().manual_seed(case["seed"])
    ps, hkv = case["page_size"], case["kv_heads"]
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
    return pool, tables, keys, values, gen


def _new(rows: list[torch.Tensor], prefixes: list[int]) -> torch.Tensor:
    """The new tokens' K or V of the given rows, packed."""
    return torch.cat([r[p:] for r, p in zip(rows, prefixes)])


@settings(max_examples=60, deadline=None)
@given(cases())
def test_paged_attention_matches_reference(case: dict) -> None:
    pool, tables, keys, values, gen = _setup(case)
    ps, pre, ext = case["page_size"], case["prefixes"], case["extends"]
    batch = ForwardBatch.build([[0] * e for e in ext], pre, tables, ps)
    # decode: every row adds one token to a context (a fresh 1-token prompt is a prefill row); a
    # MIXED step's trailing decode rows are its decode tail
    decoding = [_is_decode(p, e) for p, e in zip(pre, ext)]
    assert (batch.decode is not None) == all(decoding)
    tail = len(decoding) - next((i + 1 for i in reversed(range(len(decoding))) if not decoding[i]), 0)
    assert (0 if batch.decode_tail is None else batch.decode_tail.batch_size) == (0 if all(decoding) else tail)
    q = torch.randn(batch.num_tokens, case["kv_heads"] * case["group"], D, generator=gen)
    out = paged_attention(q, _new(keys, pre), _new(values, pre), 0, batch, pool, D**-0.5)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, keys, values, batch, D**-0.5), atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    cases().filter(
        lambda c: (
            _is_decode(c["prefixes"][-1], c["extends"][-1]) and not all(map(_is_decode, c["prefixes"], c["extends"]))
        )
    )
)
def test_mixed_step_decode_rows_are_a_decode_step_s_bits(case: dict) -> None:
    """A MIXED step's decode rows give exactly the bits the same rows give in a decode step alone
    (so --enable-mixed-chunk changes no token of a running request); its prompt rows exactly
    those of a prefill step without them."""
    pool, tables, keys, values, gen = _setup(case)
    ps, pre, ext = case["page_size"], case["prefixes"], case["extends"]
    batch = ForwardBatch.build([[0] * e for e in ext], pre, tables, ps)
    assert batch.decode_tail is not None
    n = batch.decode_tail.batch_size
    q = torch.randn(batch.num_tokens, case["kv_heads"] * case["group"], D, generator=gen)
    out = paged_attention(q, _new(keys, pre), _new(values, pre), 0, batch, pool, D**-0.5)
    d0 = batch.num_tokens - n
    alone = ForwardBatch.build([[0]] * n, pre[-n:], tables[-n:], ps)
    assert alone.decode is not None
    dec = paged_attention(q[d0:], _new(keys[-n:], pre[-n:]), _new(values[-n:], pre[-n:]), 0, alone, pool, D**-0.5)
    assert torch.equal(out[d0:], dec)
    prompts = ForwardBatch.build([[0] * e for e in ext[:-n]], pre[:-n], tables[:-n], ps)
    rows = paged_attention(q[:d0], _new(keys[:-n], pre[:-n]), _new(values[:-n], pre[:-n]), 0, prompts, pool, D**-0.5)
    assert torch.equal(out[:d0], rows)
