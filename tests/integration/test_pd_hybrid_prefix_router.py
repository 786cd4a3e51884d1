"""Prefix caching of the hybrid tiny-qwen3.5 presets (dense and MoE) through sglang-router (prefill
TP 1, decode TP 1; (1, 2), (2, 1) and the MoE preset in make test-full; Mooncake over loopback, the
decode with --disaggregation-enable-decode-radix-cache): prompts sharing a system prompt, sent in
waves, and then a four-turn conversation give the colocated engine's greedy tokens and logprobs
(no cache there); the repeated prefix shows as cached_tokens > 0 (the prefill's state snapshots)
and as decode prefix hits (each turn where the last turn's KV ended); the prefill writes exactly
the pages past the decode's prefix and one state per request; every page and state slot comes
back on both sides."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.checkpoint.config_reader import model_config_of
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

PS, NEW, TURNS = TP_PS, 4, 4


def prompts() -> list[list[int]]:
    """2 system prompts (48 and 37 tokens) x 5 questions of 20-30 tokens."""
    rnd = random.Random(3)
    out = []
    for n in (48, 37):
        system = [rnd.randrange(3, 250) for _ in range(n)]
        out += [system + [rnd.randrange(3, 250) for _ in range(rnd.randint(20, 30))] for _ in range(5)]
    return out


@dataclass(frozen=True)
class Preset:
    dir: Path
    waves: list[Generation]  # prompts(), colocated without a cache
    turns: list[list[int]]  # the conversation's prompts, each the last, its answer and a message
    turn_gens: list[Generation]


def colocated(model_dir: Path) -> Preset:
    """The colocated engine's greedy generations without a prefix cache: prompts() at once, then
    the conversation one turn after the other."""
    eng = Engine(
        ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    rnd, params = random.Random(4), SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    turns, gens, prompt = [], [], [rnd.randrange(3, 250) for _ in range(40)]
    try:
        waves = [Generation.of(o) for o in eng.generate(prompts(), params)]
        for _ in range(TURNS):
            turns.append(prompt)
            out = eng.generate([prompt], params)[0]
            gens.append(Generation.of(out))
            prompt = prompt + list(out["output_ids"]) + [rnd.randrange(3, 250) for _ in range(rnd.randint(5, 12))]
    finally:
        eng.shutdown()
    return Preset(model_dir, waves, turns, gens)


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> Callable[[str], Preset]:
    """A preset's checkpoint and colocated reference, made once per module when first asked for."""
    made: dict[str, Preset] = {}

    def get(name: str) -> Preset:
        if name not in made:
            made[name] = colocated(write_preset(name, tmp_path_factory.mktemp(name.replace(".", "_"))))
        return made[name]

    return get


# heterogeneous TP: each decode rank holds its KV heads of the cached prefix and gets its heads of
# the rest and of the state from whichever prefill rank computed them
SLOW = pytest.mark.slow
CASES = [
    ("tiny-qwen3.5", 1, 1),
    pytest.param("tiny-qwen3.5", 1, 2, marks=SLOW),
    pytest.param("tiny-qwen3.5", 2, 1, marks=SLOW),
    # the MoE preset's sparse MLP holds no per-request state: the same caches and transfer
    pytest.param("tiny-qwen3.5-moe", 1, 1, marks=SLOW),
    pytest.param("tiny-qwen3.5-moe", 1, 2, marks=SLOW),
    pytest.param("tiny-qwen3.5-moe", 2, 1, marks=SLOW),
]


@pytest.mark.parametrize("preset,p_tp,d_tp", CASES)
def test_hybrid_prefixes_through_router(presets, tmp_path: Path, preset: str, p_tp: int, d_tp: int) -> None:
    ref = presets(preset)
    model_dir, reference = ref.dir, ref.waves
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
        page = expected_bytes(model_dir, [PS], PS, p_tp, d_tp) - state_slot_nbytes(model_config_of(model_dir))
        held = 4 * 48 + 4 * 32
        assert sent == full - held // PS * page, (sent, full, page)
        stack.prefill.wait_idle(30)
        d = stack.decode.wait_idle(30)
        assert d["prefix_hit_tokens"] > 0 and d["cached_pages"] > 0
        st = disagg_stats(stack.prefill)
        assert st["rooms_failed"] == 0 and st["rooms_succeeded"] == len(ps)
        p = stack.prefill.engine_stats()
        # the second of each system prompt hits the first's deepest chunk boundary it shares (chunks
        # of 24 floored to pages: 48 of the 48-token system prompt, 16 of the 37-token one)
        assert p["cached_state_snapshots"] > 0 and p["prefix_hit_tokens"] == 4 * 48 + 16 + 3 * 32

        # a conversation: each turn resends everything so far
        turn_outs, hits = [], []
        for prompt in ref.turns:
            before = stack.decode.engine_stats()["prefix_hit_tokens"]
            body = {"input_ids": prompt, "sampling_params": greedy(NEW), "return_logprob": True}
            turn_outs.append(generate(stack.router, body))
            hits.append(stack.decode.engine_stats()["prefix_hit_tokens"] - before)
        assert_same_generations(
            [Generation.of(o) for o in turn_outs], ref.turn_gens, Route.ACROSS_PROCESSES, ref.turns, "conversation"
        )
        # the decode cached each turn up to its last KV (prompt + NEW - 1 outputs)
        assert hits == [0] + [(len(t) + NEW - 1) // PS * PS for t in ref.turns[:-1]], hits
        turn_cached = [o["meta_info"]["cached_tokens"] for o in turn_outs]
        # the prefill's own hits (a turn may reach it before it cached the last one: the prefill
        # caches a request when its transfer is over, which the router does not wait for)
        assert turn_cached[0] == 0 and any(c > 0 for c in turn_cached[1:]), turn_cached
        # bytes per follow-up: its pages past the decode's prefix and one state, nothing more
        stack.prefill.wait_idle(30)
        stack.decode.wait_idle(30)
        state = state_slot_nbytes(model_config_of(model_dir))
        predicted = sum((-(-len(t) // PS) - h // PS) * page + state for t, h in zip(ref.turns, hits))
        assert disagg_stats(stack.prefill)["bytes_written"] - sent == predicted
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)
