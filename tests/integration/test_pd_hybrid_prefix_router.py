"""Prefix caching of the hybrid tiny-qwen3.5 preset through sglang-router (prefill TP 1, decode TP 1;
(1, 2) and (2, 1) in make test-full; Mooncake over loopback, the decode with
--disaggregation-enable-decode-radix-cache): prompts sharing a system prompt, sent in waves, give
the colocated engine's greedy tokens and logprobs (no cache there); the repeated prefix shows as
cached_tokens > 0 (the prefill's state snapshots) and as decode prefix hits; the prefill writes
exactly the pages past the decode's prefix and one state per request; every page and state slot
comes back on both sides."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.config import ModelConfig
from kvpipe.model.presets import write_preset
from tests.helpers.pd_parity import expected_bytes, state_slot_nbytes
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

PS, NEW = TP_PS, 4


def prompts() -> list[list[int]]:
    """2 system prompts (48 and 37 tokens) x 5 questions of 20-30 tokens."""
    rnd = random.Random(3)
    out = []
    for n in (48, 37):
        system = [rnd.randrange(3, 250) for _ in range(n)]
        out += [system + [rnd.randrange(3, 250) for _ in range(rnd.randint(20, 30))] for _ in range(5)]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35_router"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[Generation]:
    eng = Engine(
        ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    try:
        outs = eng.generate(prompts(), SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    finally:
        eng.shutdown()
    return [Generation.of(o) for o in outs]


# heterogeneous TP: each decode rank holds its KV heads of the cached prefix and gets its heads of
# the rest and of the state from whichever prefill rank computed them
@pytest.mark.parametrize(
    "p_tp,d_tp", [(1, 1), pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow)]
)
def test_hybrid_prefixes_through_router(model_dir: Path, tmp_path: Path, reference, p_tp: int, d_tp: int) -> None:
    ps = prompts()
    stack = start_stack(
        model_dir,
        tmp_path,
        *TP_FLAGS,
        "--chunked-prefill-size",
        "24",
        prefill_args=("--tp-size", str(p_tp)),
        decode_args=("--tp-size", str(d_tp), "--disaggregation-enable-decode-radix-cache"),  # a decode-only flag
    )
    try:

        def one(i: int) -> dict:
            return generate(stack.router, {"input_ids": ps[i], "sampling_params": greedy(NEW), "return_logprob": True})

        # waves: the first of each system prompt, then the second (the prefill snapshots the
        # branch point), then the rest concurrently (they hit it)
        waves = [[0, 5], [1, 6], [2, 3, 4, 7, 8, 9]]
        outs: dict[int, dict] = {}
        for wave in waves:
            with ThreadPoolExecutor(len(wave)) as pool:
                outs.update(zip(wave, pool.map(one, wave)))
        got = [Generation.of(outs[i]) for i in range(len(ps))]
        assert_same_generations(
            got, reference, Route.ACROSS_PROCESSES, ps, f"hybrid PD ({p_tp}, {d_tp}) through the router"
        )
        cached = {i: outs[i]["meta_info"]["cached_tokens"] for i in range(len(ps))}
        assert [cached[i] for i in waves[2]] == [48, 48, 48, 32, 32, 32], cached
        # the decode held the shared pages from the second of each system prompt on (its cache
        # keeps KV alone): every request moved its other pages and its state, nothing more
        sent = disagg_stats(stack.prefill)["bytes_written"]
        full = expected_bytes(model_dir, [len(p) for p in ps], PS, p_tp, d_tp)  # nothing cached, states included
        page = expected_bytes(model_dir, [PS], PS, p_tp, d_tp) - state_slot_nbytes(ModelConfig.from_dir(model_dir))
        held = 4 * 48 + 4 * 32
        assert sent == full - held // PS * page, (sent, full, page)
        stack.prefill.wait_idle(30)
        d = stack.decode.wait_idle(30)
        assert d["prefix_hit_tokens"] > 0 and d["cached_pages"] > 0
        st = disagg_stats(stack.prefill)
        assert st["rooms_failed"] == 0 and st["rooms_succeeded"] == len(ps)
        p = stack.prefill.engine_stats()
        assert p["cached_state_snapshots"] > 0 and p["prefix_hit_tokens"] == 3 * 48 + 3 * 32
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)
