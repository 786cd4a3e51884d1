"""CUDA paths of the engine (skipped without a GPU): the model, the paged pool and layer groups on
the device give the CPU's greedy tokens and logprobs (within Route.ACROSS_DEVICES), they depend on
the context (a wrong page would show), and the pool's buffers are device memory. With
--kv-cache-dtype bfloat16 / fp8_e4m3 the device pool stores that dtype and its generations stay
closer to the CPU's with the same KV dtype than that dtype's own effect (against fp32 KV)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from tests.helpers.engine import assert_context_matters
from tests.helpers.tolerance import Generation, Route, assert_same_generations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + (i * 7) % 200 for i in range(n)] for n in (1, 13, 64, 150)]
KV_TORCH = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def _outputs(
    model_dir: Path,
    device: str,
    prompts: list[list[int]] = PROMPTS,
    chunk: int = 0,
    layer_groups: int = 1,
    kv_cache_dtype: str = "auto",
) -> list[Generation]:
    cfg = ServerConfig(
        model_path=str(model_dir),
        device=device,
        dtype="float32",  # CUDA's auto is the checkpoint's dtype; the CPU's is fp32
        cache=CacheConfig(page_size=16, num_pages=128, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk),
    )
    eng = Engine(cfg, layer_groups=layer_groups)
    try:
        assert eng.runner.pool.k[0].device.type == device
        assert eng.runner.pool.k[0].dtype == KV_TORCH.get(kv_cache_dtype, torch.float32)
        return [Generation.of(r) for r in eng.generate(prompts, GREEDY)]
    finally:
        eng.shutdown()


def test_cuda_greedy_matches_cpu(tiny_model_dir: Path) -> None:
    cpu = _outputs(tiny_model_dir, "cpu")
    assert_same_generations(_outputs(tiny_model_dir, "cuda"), cpu, Route.ACROSS_DEVICES, PROMPTS, "cuda")
    chunked = _outputs(tiny_model_dir, "cuda", chunk=33, layer_groups=2)
    assert_same_generations(chunked, cpu, Route.ACROSS_DEVICES, PROMPTS, "cuda, chunked, 2 layer groups")


def test_cuda_outputs_depend_on_the_context(tiny_model_dir: Path) -> None:
    """The same last token after other earlier tokens changes the device's outputs: the check
    above would see a wrong page (the prompts of 2+ tokens)."""
    ps = PROMPTS[1:]
    assert_context_matters(lambda x: _outputs(tiny_model_dir, "cuda", x), ps, _outputs(tiny_model_dir, "cuda", ps))


def test_cuda_pool_exposes_device_addresses(tiny_model_dir: Path) -> None:
    cfg = dataclasses.replace(
        ServerConfig(model_path=str(tiny_model_dir), device="cuda"), cache=CacheConfig(page_size=16, num_pages=8)
    )
    eng = Engine(cfg)
    try:
        infos = eng.runner.pool.buffer_infos()
        assert len(infos) == 2 * eng.model_config.num_layers
        assert all(i.addr == t.data_ptr() for i, t in zip(infos[::2], eng.runner.pool.k))
    finally:
        eng.shutdown()


def _largest_logprob_gap(a: list[Generation], b: list[Generation]) -> float:
    """Largest |logprob difference| over each prompt's common token prefix (after a token differs
    the two runs condition on other text)."""
    gap = 0.0
    for x, y in zip(a, b):
        for tx, ty, lx, ly in zip(x.tokens, y.tokens, x.logprobs, y.logprobs):
            if tx != ty:
                break
            gap = max(gap, abs(lx - ly))
    return gap


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_cuda_kv_cache_dtype_follows_the_cpu(tiny_model_dir: Path, kv: str) -> None:
    """The device pool stores `kv` and decodes through it: against the CPU with the same KV dtype
    the logprobs move far less than the dtype itself moves them (CPU `kv` against CPU fp32 KV).
    Exactness is not asked for: the two devices' K/V differ by fp32 roundings, and a value near an
    fp8 (bf16) rounding boundary can round the other way, which moves logprobs by more than
    Route.ACROSS_DEVICES allows. A device that ignored the flag, or read the bytes with the wrong
    format or scale, would be as far from the CPU as fp32 KV is, or farther."""
    cpu = _outputs(tiny_model_dir, "cpu", kv_cache_dtype=kv, chunk=33)  # chunks read stored KV: the same ones
    cpu_fp32 = _outputs(tiny_model_dir, "cpu", chunk=33)
    cuda = _outputs(tiny_model_dir, "cuda", kv_cache_dtype=kv, chunk=33, layer_groups=2)
    dtype_effect = _largest_logprob_gap(cpu, cpu_fp32)
    assert dtype_effect > 0, f"{kv} KV changed nothing on the CPU"
    assert _largest_logprob_gap(cuda, cpu) < 0.5 * dtype_effect
