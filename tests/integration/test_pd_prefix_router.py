"""Prefix caching on both PD servers through sglang-router, with TP on either side (Mooncake over
loopback): 32 prompts sharing 4 prefixes (page-aligned and not), chunked prefill that does not
divide the page size, layer pipelining on and off. Greedy tokens and logprobs equal the colocated
engine with no cache; the decode reports the prefill's cached tokens natively and in OpenAI usage; the
prefill sends less KV than the prompts hold; every page comes back on both sides."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from tests.helpers.pd_parity import colocated_reference, expected_bytes
from tests.helpers.pd_stack import (
    TP_FLAGS,
    TP_PS,
    close_and_check_no_orphans,
    disagg_stats,
    generate,
    greedy,
    start_stack,
    start_tp_stack,
)
from tests.helpers.prefix_prompts import shared_prefix_prompts
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytest.importorskip("mooncake.engine")

PS, NEW = TP_PS, 4  # the tiny preset, fp32


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[Generation]:
    eng = Engine(
        ServerConfig(model_path=str(tiny_model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    try:
        outs = eng.generate(
            shared_prefix_prompts(2), SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        )
    finally:
        eng.shutdown()
    return [Generation.of(o) for o in outs]


@pytest.mark.parametrize("p_tp,d_tp,groups", [(1, 2, 2), pytest.param(2, 1, 1, marks=pytest.mark.slow)])
def test_cached_prefixes_through_router(
    tiny_model_dir: Path, tmp_path: Path, reference, p_tp: int, d_tp: int, groups: int
) -> None:
    ps = shared_prefix_prompts(2)
    stack = start_tp_stack(
        tiny_model_dir,
        tmp_path,
        p_tp,
        d_tp,
        ("--chunked-prefill-size", "24", "--disaggregation-layer-groups", str(groups)),
    )
    # the decode cache is a decode-only flag: restart the decode with it
    stack.decode.proc.terminate()
    stack.decode.proc.wait(30)
    stack.restart("decode", "--disaggregation-enable-decode-radix-cache")
    try:

        def one(i: int) -> dict:
            return generate(stack.router, {"input_ids": ps[i], "sampling_params": greedy(NEW), "return_logprob": True})

        first = list(range(0, len(ps), 8))  # one prompt per prefix fills both caches
        rest = [i for i in range(len(ps)) if i % 8]
        outs = {i: one(i) for i in first}
        with ThreadPoolExecutor(8) as pool:
            outs.update(zip(rest, pool.map(one, rest)))
        # TP servers against this process's TP 1 engine: Route.ACROSS_PROCESSES
        got = [Generation.of(outs[i]) for i in range(len(ps))]
        assert_same_generations(got, reference, Route.ACROSS_PROCESSES, ps, f"prefill TP {p_tp}, decode TP {d_tp}")
        cached = [outs[i]["meta_info"]["cached_tokens"] for i in rest]
        kv_prompts = disagg_stats(stack.prefill)["bytes_written"]  # every write of the 32 prompts is done
        assert all(c % PS == 0 for c in cached) and sum(c > 0 for c in cached) >= len(rest) // 2, cached
        # OpenAI usage reports the same through the router: the second of two equal prompts hits
        usage = []
        for _ in range(2):
            r = httpx.post(
                stack.router + "/v1/completions",
                json={
                    "model": tiny_model_dir.name,
                    "prompt": "the quick brown fox jumps over the lazy dog " * 12,
                    "max_tokens": 2,
                    "temperature": 0,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0, usage
        assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= PS, usage
        stack.prefill.wait_idle(30)
        d = stack.decode.wait_idle(30)
        assert d["prefix_hit_tokens"] > 0 and d["cached_pages"] > 0
        assert stack.decode.metric("kvpipe_prefix_hit_tokens_total") == d["prefix_hit_tokens"]
        assert stack.decode.metric("kvpipe_cached_pages") == d["cached_pages"]
        st = disagg_stats(stack.prefill)
        assert st["rooms_failed"] == 0 and st["rooms_succeeded"] == len(ps) + 2
        full = expected_bytes(tiny_model_dir, [len(p) for p in ps], PS, p_tp, d_tp)  # with nothing cached
        assert kv_prompts < 0.6 * full, (kv_prompts, full)
        assert stack.prefill.metric("kvpipe_kv_transfer_bytes_total") == st["bytes_written"]
        # Mooncake's glog INFO lines stay out of the servers' output unless --log-level debug
        assert not re.search(
            r"^I\d{4} ", (tmp_path / "prefill.log").read_text(errors="replace"), re.M
        )  # the decode held the prefixes
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)


def test_decode_cache_with_fp8_kv(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--kv-cache-dtype fp8_e4m3 with the decode's radix cache (issue 26): the decode reuses the fp8
    pages it holds and receives only the rest. The prefill computes whole prompts and keeps no
    cache (a cached prefix would be read back rounded at a chunk boundary the colocated reference
    does not have), so every request's KV equals the colocated engine's with the same KV dtype."""
    ps = shared_prefix_prompts(2)
    reference = colocated_reference(tiny_model_dir, ps, NEW, PS, "fp8_e4m3", chunk=0, radix_cache=False)
    stack = start_stack(
        tiny_model_dir,
        tmp_path,
        *TP_FLAGS,
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--chunked-prefill-size",
        "0",
        "--disaggregation-layer-groups",
        "2",
        prefill_args=("--disable-radix-cache",),
        decode_args=("--disaggregation-enable-decode-radix-cache",),
    )
    try:

        def one(i: int) -> dict:
            return generate(stack.router, {"input_ids": ps[i], "sampling_params": greedy(NEW), "return_logprob": True})

        first = list(range(0, len(ps), 8))  # one prompt per prefix fills the decode's cache
        rest = [i for i in range(len(ps)) if i % 8]
        outs = {i: one(i) for i in first}
        with ThreadPoolExecutor(8) as pool:
            outs.update(zip(rest, pool.map(one, rest)))
        got = [Generation.of(outs[i]) for i in range(len(ps))]
        assert_same_generations(got, reference, Route.ACROSS_PROCESSES, ps, "fp8 KV, decode radix cache")
        stack.prefill.wait_idle(30)
        d = stack.decode.wait_idle(30)
        assert d["prefix_hit_tokens"] > 0 and d["cached_pages"] > 0, d
        st = disagg_stats(stack.prefill)
        assert st["rooms_failed"] == 0 and st["rooms_succeeded"] == len(ps), st
        # fp8 pages (1 byte per element), fewer of them than the prompts hold
        full = expected_bytes(tiny_model_dir, [len(p) for p in ps], PS, 1, 1, kv_itemsize=1)
        assert 0 < st["bytes_written"] < 0.6 * full, (st["bytes_written"], full)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)
