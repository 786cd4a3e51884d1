"""--kv-cache-dtype on the colocated engine: each KV dtype's greedy generations through the C++
decode kernel equal the torch path's (both read the same stored values and dequantize them
exactly into fp32, so only the order of fp32 sums differs: Route.SAME_PROCESS, until a decode
step's new K/V, computed from those sums, lands next to a rounding boundary of the KV dtype and is
stored as the neighbouring code on one side: rounding_flip_atol), with chunked
prefill (a later chunk reads the stored prefix) on every family's KV layout (GQA, MLA latent,
GPT-OSS window pages and sinks, Qwen3.5's full-attention layers next to its fp32 state); a
prefix-cache hit reads stored KV exactly as a chunk boundary at the same place does; and a
negative control: bf16 and fp8 KV change the generations of fp32 KV (the flag is not ignored)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from kvpipe.model.cpu.kernels import loader
from kvpipe.model.presets import write_preset
from tests.helpers.engine import generations, make_engine, prompts
from tests.helpers.tolerance import (
    Generation,
    Route,
    assert_same_generations,
    generation_atol,
    generation_difference,
)

PROMPTS = prompts()
KV_DTYPES = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_preset(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def fp32_reference(preset: Callable[[str], Path]) -> Callable[[str], list[Generation]]:
    """A preset's generations with an fp32 pool on the torch path, made once per module (the scale
    rounding_flip_atol derives its bound from)."""
    made: dict[str, list[Generation]] = {}

    def get(name: str) -> list[Generation]:
        if name not in made:
            with pytest.MonkeyPatch.context() as mp:
                made[name] = run(preset(name), "auto", False, mp)
        return made[name]

    return get


def run(model_dir: Path, kv: str, kernel: bool, monkeypatch: pytest.MonkeyPatch, chunk: int = 24, **kw):
    monkeypatch.setenv(loader.DISABLE_ENV, "1" if kernel else "0")
    eng = make_engine(model_dir, chunk=chunk, kv_cache_dtype=kv, **kw)
    try:
        pool = eng.runner.pool
        assert pool.k[0].dtype == TORCH_DTYPES.get(kv, torch.float32) and pool.compute_dtype == torch.float32
        return generations(eng, PROMPTS)
    finally:
        eng.shutdown()


def rounding_flip_atol(low: Sequence[Generation], fp32: Sequence[Generation]) -> float:
    """How far the kernel and torch paths' generations of one low-precision KV dtype may drift
    apart: their attention sums differ in the last fp32 bits, and a decode step's new K/V computed
    from them can land on either side of a rounding boundary of the KV dtype, so one stored value
    differs by one code from then on (seen once on an AMD EPYC in fp8 e4m3: 1.9e-3, where every
    other prompt stayed at 1e-6; on a Zen 3 EPYC in fp16: 5.1e-5, 0.31 of the smallest effect).
    One such value is a small part of what rounding every stored value does, the dtype's own
    effect against the fp32 pool: at most half of the smallest such effect over the prompts (tiny
    preset: 0.026-0.88 in e4m3, 1.7e-4-8e-4 in fp16). A wrong dequantization, scale or page moves
    the logprobs by that effect or more."""
    effects = [
        max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) for g, r in zip(low, fp32) if g.tokens == r.tokens
    ]
    assert effects, "every prompt's tokens changed with the KV dtype: no effect to scale from"
    return min(effects) / 2


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_kernel_equals_torch_path_per_kv_dtype(preset, fp32_reference, monkeypatch, kv: str) -> None:
    fast = run(preset("tiny"), kv, True, monkeypatch)
    slow = run(preset("tiny"), kv, False, monkeypatch)
    flip = rounding_flip_atol(slow, fp32_reference("tiny"))
    assert_same_generations(fast, slow, Route.SAME_PROCESS, PROMPTS, f"{kv} KV, kernel vs torch path", flip)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-gpt-oss", "tiny-qwen3.5"])
def test_families_with_fp8_kv(preset, fp32_reference, monkeypatch, name: str) -> None:
    """MLA's latent pool (one scale for keys and values), GPT-OSS's window pages and sinks, and
    Qwen3.5's full-attention layers (its recurrent state stays fp32) in fp8 e4m3."""
    fast = run(preset(name), "fp8_e4m3", True, monkeypatch)
    slow = run(preset(name), "fp8_e4m3", False, monkeypatch)
    flip = rounding_flip_atol(slow, fp32_reference(name))
    assert_same_generations(fast, slow, Route.SAME_PROCESS, PROMPTS, f"{name}, fp8 KV, kernel vs torch path", flip)
    if name == "tiny-qwen3.5":
        eng = make_engine(preset(name), kv_cache_dtype="fp8_e4m3")
        try:
            state = eng.runner.state_pool
            assert state is not None and state.conv[0].dtype == torch.float32
            assert state.recurrent[0].dtype == torch.float32
        finally:
            eng.shutdown()


def test_prefix_hit_reads_stored_kv_like_a_chunk_boundary(preset, monkeypatch) -> None:
    """fp8: a prompt behind a cached 64-token prefix reads that prefix from the pool, as a cold run
    whose first chunk ends at token 64 does (whole prompts attend to their own unquantized K/V)."""
    base, tails = PROMPTS[3], [PROMPTS[4][:20], PROMPTS[5][:33]]
    assert len(base) == 64
    longer = [base + t for t in tails]
    monkeypatch.setenv(loader.DISABLE_ENV, "1")
    eng = make_engine(preset("tiny"), radix_cache=True, kv_cache_dtype="fp8_e4m3")
    try:
        generations(eng, [base])
        hit = [generations(eng, [p])[0] for p in longer]
        assert eng.stats()["prefix_hit_tokens"] == 2 * 64
    finally:
        eng.shutdown()
    eng = make_engine(preset("tiny"), chunk=64, kv_cache_dtype="fp8_e4m3")
    try:
        cold = [generations(eng, [p])[0] for p in longer]
    finally:
        eng.shutdown()
    assert_same_generations(hit, cold, Route.SAME_PROCESS, longer, "fp8 prefix hit vs chunk boundary")


def test_low_precision_kv_changes_the_generations(preset, monkeypatch) -> None:
    """Negative control: the fp32 pool's generations against bf16's and fp8's differ beyond the
    exactness bound on some prompt (a KV dtype flag that was ignored would pass every test above)."""
    ref = run(preset("tiny"), "auto", True, monkeypatch)
    atol = generation_atol(Route.SAME_PROCESS, ref)
    for kv in ("bfloat16", "fp8_e4m3"):
        got = run(preset("tiny"), kv, True, monkeypatch)
        diffs = [generation_difference(g, r, atol) for g, r in zip(got, ref)]
        assert any(d is not None for d in diffs), f"{kv} KV generated exactly what fp32 KV did"
