"""Prefix caching of tiny-gpt-oss (window 32) through sglang-router, TP (1, 1) and heterogeneous
(prefill TP 1 / decode TP 2, and 2 / 1), Mooncake over loopback, the decode with
--disaggregation-enable-decode-radix-cache: a four-turn conversation and four prompts sharing a
system prompt give the colocated engine's greedy tokens and logprobs (no cache there). Each later
turn hits the decode's cache where the last turn's KV ended; each prompt after the first hits the
system prompt's full pages in the decode's cache (its window slid out of the request that cached
it: the decode computes nothing, it needs only its prompt's last window) and the prefill's
(cached_tokens > 0). The prefill ranks write exactly the full-layer pages past the decode's prefix
and the window pages of the prompt's last window the decode's cache lacks, below its prefix too,
each decode rank's heads once; every page comes back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvpipe.cache.window_pages import window_first_page
from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.presets import write_preset
from tests.helpers.pd_stack import (
    TP_FLAGS,
    TP_PS,
    close_and_check_no_orphans,
    disagg_stats,
    generate,
    greedy,
    start_stack,
)
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.engine")

PS, NEW, TURNS = TP_PS, 4, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny_gpt_oss_router_cache"))


@pytest.fixture(scope="module")
def conversation(model_dir: Path) -> tuple[list[list[int]], list[Generation]]:
    """TURNS prompts, each the last one, its answer and a new message, with the colocated engine's
    generations (no prefix cache)."""
    rnd = random.Random(4)
    eng = Engine(
        ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    ps, gens, prompt = [], [], [rnd.randrange(3, 250) for _ in range(40)]
    try:
        for _ in range(TURNS):
            ps.append(prompt)
            out = eng.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))[0]
            gens.append(Generation.of(out))
            prompt = prompt + list(out["output_ids"]) + [rnd.randrange(3, 250) for _ in range(rnd.randint(5, 12))]
    finally:
        eng.shutdown()
    return ps, gens


@pytest.fixture(scope="module")
def system_prompts(model_dir: Path) -> tuple[list[list[int]], list[Generation]]:
    """Four prompts of a 40-token system prompt and 30, 20, 21, 28 more tokens, with the colocated
    engine's generations (no prefix cache)."""
    rnd = random.Random(5)
    system = [rnd.randrange(3, 250) for _ in range(40)]
    ps = [system + [rnd.randrange(3, 250) for _ in range(n)] for n in (30, 20, 21, 28)]
    eng = Engine(
        ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    try:
        gens = [Generation.of(eng.generate([p], params)[0]) for p in ps]  # each alone
    finally:
        eng.shutdown()
    return ps, gens


@pytest.mark.parametrize(
    "p_tp,d_tp", [(1, 1), pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow)]
)
def test_conversation_and_system_prompt_hit_both_caches_through_router(
    model_dir: Path, tmp_path: Path, conversation, system_prompts, p_tp, d_tp
):
    ps, want = conversation
    mc = model_config_of(model_dir)
    assert mc.sliding_window is not None and mc.num_kv_heads % 2 == 0  # each decode rank's heads once
    layer_page = PS * mc.num_kv_heads * mc.head_dim * 4 * 2
    full_page = (mc.num_layers - len(mc.sliding_layers)) * layer_page
    window_page = len(mc.sliding_layers) * layer_page

    def predicted(n: int, hit: int, held: int) -> int:
        """The full pages past the decode's prefix of `hit` tokens; the pages of the prompt's last
        window but the `held` ones the decode's cache has (below `hit`)."""
        end, first = -(-n // PS), window_first_page(n, mc.sliding_window, PS)
        return (end - hit // PS) * full_page + (end - first - held) * window_page

    stack = start_stack(
        model_dir,
        tmp_path,
        *TP_FLAGS,
        "--chunked-prefill-size",
        "24",
        prefill_args=("--tp-size", str(p_tp)),
        decode_args=("--tp-size", str(d_tp), "--disaggregation-enable-decode-radix-cache"),
    )
    try:
        outs, hits = [], []
        for prompt in ps:  # one turn after the other: each resends the conversation so far
            before = stack.decode.engine_stats()["prefix_hit_tokens"]
            body = {"input_ids": prompt, "sampling_params": greedy(NEW), "return_logprob": True}
            outs.append(generate(stack.router, body))
            hits.append(stack.decode.engine_stats()["prefix_hit_tokens"] - before)
        got = [Generation.of(o) for o in outs]
        assert_same_generations(got, want, Route.ACROSS_PROCESSES, ps, f"GPT-OSS PD ({p_tp}, {d_tp}), both caches")
        # the decode cached each turn up to its last KV (prompt + NEW - 1 outputs), window included
        assert hits == [0] + [(len(p) + NEW - 1) // PS * PS for p in ps[:-1]], hits
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        # the prefill's own hits (a turn may reach it before it cached the last one: the prefill
        # caches a request when its transfer is over, which the router does not wait for)
        assert cached[0] == 0 and any(c > 0 for c in cached[1:]) and all(c % PS == 0 for c in cached), cached
        # the last turn's window before its end is the cache's: held is every page of it below hit
        sent = sum(
            predicted(len(p), h, max(0, h // PS - window_first_page(len(p), mc.sliding_window, PS)))
            for p, h in zip(ps, hits)
        )
        stack.prefill.wait_idle(30)
        stack.decode.wait_idle(30)
        st = disagg_stats(stack.prefill)
        assert (st["rooms_succeeded"], st["rooms_failed"]) == (TURNS, 0), st
        assert st["bytes_written"] == sent, (st["bytes_written"], sent)

        sys_ps, sys_want = system_prompts
        outs, hits, written = [], [], st["bytes_written"]
        for prompt in sys_ps:
            before = stack.decode.engine_stats()["prefix_hit_tokens"]
            body = {"input_ids": prompt, "sampling_params": greedy(NEW), "return_logprob": True}
            outs.append(generate(stack.router, body))
            hits.append(stack.decode.engine_stats()["prefix_hit_tokens"] - before)
            stack.prefill.wait_idle(30)  # it cached the prompt: its own hits below are known
        got = [Generation.of(o) for o in outs]
        assert_same_generations(
            got, sys_want, Route.ACROSS_PROCESSES, sys_ps, f"GPT-OSS PD ({p_tp}, {d_tp}), a shared system prompt"
        )
        # the decode: the system prompt's 2 full pages from the second prompt on; of its last
        # window (from page 2, 1, 1, 2) the page before them (1) is the prefill's to send to the
        # second (no request had it), the decode cache's for the third (the second kept it)
        assert hits == [0, 32, 32, 32], hits
        # the prefill: the second prompt's window there slid out of the first, it keeps it
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 32, 32]
        sent = sum(predicted(len(p), h, held) for p, h, held in zip(sys_ps, hits, [0, 0, 1, 0]))
        d = stack.decode.wait_idle(30)
        st = disagg_stats(stack.prefill)
        assert (st["rooms_succeeded"], st["rooms_failed"]) == (2 * TURNS, 0), st
        assert st["bytes_written"] - written == sent, (st["bytes_written"] - written, sent)
        assert d["cached_pages"] > 0 and d["tp_size"] == d_tp
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)
