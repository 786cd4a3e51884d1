"""CUDA paths of the engine (skipped without a GPU): the model, the paged pool and layer groups on
the device give the CPU's greedy tokens and logprobs (within Route.ACROSS_DEVICES), they depend on
the context (a wrong page would show), and the pool's buffers are device memory."""

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


def _outputs(
    model_dir: Path, device: str, prompts: list[list[int]] = PROMPTS, chunk: int = 0, layer_groups: int = 1
) -> list[Generation]:
    cfg = ServerConfig(
        model_path=str(model_dir),
        device=device,
        cache=CacheConfig(page_size=16, num_pages=128),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk),
    )
    eng = Engine(cfg, layer_groups=layer_groups)
    try:
        assert eng.runner.pool.k[0].device.type == device
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
