"""PD through the router vs a colocated engine, for any model: greedy tokens and logprobs of
concurrent prompts, every page back afterwards, and every prefill rank's written bytes equal to
what the TP mapping predicts for the model's KV layout (K/V head slices, or an MLA latent), plus a
hybrid model's recurrent state (one whole slot per request, any TP pairing)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvpipe.cache.window_pages import prompt_window_pages
from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.schema import ModelConfig
from tests.helpers.pd_stack import Stack, disagg_stats, generate, greedy, start_stack
from tests.helpers.tolerance import Generation, Route, assert_same_generations

# 24 prompt lengths from 1 to 150 tokens: around pages of 16, a window of 32 and chunks of 64
MANY_LENGTHS = [150, 37, 90, 1, 5, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 96, 97, 111, 120, 128, 129, 140]

# PD (TP on either side, other processes) against the colocated TP 1 engine of the test process:
# tolerance.Route.ACROSS_PROCESSES (TP all-reduces and other matmul blockings reorder fp32 sums,
# ~1e-6 measured; a KV head missing or misplaced on one decode rank moves the logprobs ~1e-2).
ROUTE = Route.ACROSS_PROCESSES


def prompts(lengths: list[int], vocab: int = 290, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# bytes of one stored KV element per --kv-cache-dtype on CPU (auto: the fp32 model dtype)
KV_ITEMSIZE = {"auto": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def colocated_reference(
    model_dir: Path,
    ids: list[list[int]],
    new_tokens: int,
    page_size: int,
    kv_cache_dtype: str = "auto",
    chunk: int | None = None,
    radix_cache: bool = True,
    num_pages: int = 128,
) -> list[Generation]:
    """Colocated TP 1 engine: greedy tokens and logprobs per prompt; `chunk`: its
    --chunked-prefill-size (None: the default). With a low-precision KV dtype compare whole
    prompts (chunk 0 here and on the PD servers): a later chunk reads the stored, rounded KV of
    the earlier ones, and where chunks end depends on which requests share a step; for prompts
    sharing prefixes also turn the prefix cache off (`radix_cache`): a hit is such a chunk end."""
    cache = CacheConfig(
        page_size=page_size, num_pages=num_pages, kv_cache_dtype=kv_cache_dtype, radix_cache=radix_cache
    )
    sched = SchedulerConfig() if chunk is None else SchedulerConfig(chunked_prefill_size=chunk)
    eng = Engine(ServerConfig(model_path=str(model_dir), cache=cache, scheduler=sched))
    try:
        outs = eng.generate(ids, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    finally:
        eng.shutdown()
    return [Generation.of(o) for o in outs]


def expected_bytes(
    model_dir: Path,
    lengths: list[int],
    page_size: int,
    p_tp: int,
    d_tp: int,
    itemsize: int = 4,
    kv_itemsize: int | None = None,
) -> int:
    """Bytes every prefill rank together writes for the prompts: whole pages, each decode rank's
    heads once (decode ranks sharing a replicated head, or the MLA latent, each get it); a hybrid
    model's KV is that of its full-attention layers, and each request's state moves once: every
    linear head of its slot from the one prefill rank that holds it (linear heads are never
    replicated). A sliding-window layer moves only the pages the decode's first query can see:
    from the one holding token n - window + 1 of an n-token prompt on.

    Written from the layout alone, not from the production planner (transfer_slices): a decode
    rank holds kv_heads / d_tp heads when d_tp divides the KV heads, else one replicated head
    (d_tp / kv_heads ranks share each); an MLA latent is one "head" every decode rank holds whole.
    Each decode rank's heads are written once, whichever prefill TP computed them. `itemsize`:
    the model dtype's (a hybrid model's conv state); `kv_itemsize`: the KV pool's
    (--kv-cache-dtype; default `itemsize`)."""
    mc = model_config_of(model_dir)
    kv_heads = mc.kv_cache_heads  # 1 for the MLA latent
    assert kv_heads % d_tp == 0 or d_tp % kv_heads == 0, (kv_heads, d_tp)
    heads = d_tp * max(1, kv_heads // d_tp)
    sliding = [layer for layer in mc.kv_layers if mc.window(layer) is not None]
    full_pages = sum(-(-n // page_size) for n in lengths)
    window_pages = (
        sum(end - first for first, end in (prompt_window_pages(n, mc.sliding_window, page_size) for n in lengths))
        if sliding and mc.sliding_window is not None  # the one implies the other (ModelConfig.window)
        else 0
    )
    layer_pages = full_pages * (len(mc.kv_layers) - len(sliding)) + window_pages * len(sliding)
    kv_item = itemsize if kv_itemsize is None else kv_itemsize
    kv = layer_pages * heads * page_size * mc.kv_cache_head_dim * kv_item * mc.kv_buffers_per_layer
    return kv + len(lengths) * state_slot_nbytes(mc, itemsize)


def state_slot_nbytes(mc: ModelConfig, itemsize: int = 4) -> int:
    """One request's recurrent state over every linear layer and every TP rank: the conv state
    [conv_dim, kernel - 1] in the model dtype and the delta-rule state [heads, Dk, Dv] in fp32."""
    h = mc.hybrid
    if h is None:
        return 0
    conv = h.conv_dim * (h.conv_kernel - 1) * itemsize
    recurrent = h.linear_value_heads * h.linear_key_head_dim * h.linear_value_head_dim * 4
    return len(h.linear_layers) * (conv + recurrent)


def check_parity(
    stack: Stack,
    model_dir: Path,
    ids: list[list[int]],
    reference,
    new_tokens: int,
    page_size: int,
    p_tp: int,
    d_tp: int,
    groups: int,
    kv_cache_dtype: str = "auto",
) -> None:
    def one(prompt: list[int]) -> dict:
        return generate(
            stack.router, {"input_ids": prompt, "sampling_params": greedy(new_tokens), "return_logprob": True}
        )

    with ThreadPoolExecutor(len(ids)) as pool:  # concurrent: prefill batches several rooms
        outs = list(pool.map(one, ids))
    got = [Generation.of(out) for out in outs]
    what = f"prefill TP {p_tp}, decode TP {d_tp}, {groups} groups, KV {kv_cache_dtype}"
    assert_same_generations(got, reference, ROUTE, ids, what)
    p = stack.prefill.wait_idle(30)  # every page back on both sides
    stack.decode.wait_idle(30)
    st = disagg_stats(stack.prefill)
    assert (st["rooms_succeeded"], st["rooms_failed"]) == (len(ids), 0), st
    lengths = [len(x) for x in ids]
    want = expected_bytes(model_dir, lengths, page_size, p_tp, d_tp, kv_itemsize=KV_ITEMSIZE[kv_cache_dtype])
    assert st["bytes_written"] == want, st
    assert p["tp_size"] == p_tp and stack.decode.engine_stats()["tp_size"] == d_tp
    if groups > 1:
        assert p["layer_group_batches"].get(str(groups), 0) > 0, p["layer_group_batches"]


def run_router_pd(
    model: tuple[Path, list],
    tmp_path: Path,
    flags: list[str],
    p_tp: int,
    d_tp: int,
    groups: int,
    lengths: list[int],
    new_tokens: int,
    page_size: int,
    kv_cache_dtype: str = "auto",
    ids: list[list[int]] | None = None,
) -> None:
    """A router PD stack of (model dir, colocated reference) on TP (p_tp, d_tp) with `groups`
    layer groups and `kv_cache_dtype` on both sides (the reference's too): check_parity on
    prompts `ids` (None: random ones of `lengths`); the stack's logs are printed on failure."""
    model_dir, reference = model
    stack = start_stack(
        model_dir,
        tmp_path,
        *flags,
        "--disaggregation-layer-groups",
        str(groups),
        "--kv-cache-dtype",
        kv_cache_dtype,
        prefill_args=("--tp-size", str(p_tp)),
        decode_args=("--tp-size", str(d_tp)),
    )
    try:
        check_parity(
            stack,
            model_dir,
            prompts(lengths) if ids is None else ids,
            reference,
            new_tokens,
            page_size,
            p_tp,
            d_tp,
            groups,
            kv_cache_dtype,
        )
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.close()
