"""Helpers shared by the engine integration tests."""

from __future__ import annotations

import random
from pathlib import Path

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def prompts(n: int = 6, seed: int = 0, vocab: int = 250) -> list[list[int]]:
    """Token-id prompts of mixed lengths (1 to 150 tokens), deterministic."""
    rnd = random.Random(seed)
    lens = [1, 5, 17, 64, 100, 150][:n] + [rnd.randint(2, 90) for _ in range(max(0, n - 6))]
    return [[rnd.randrange(3, vocab) for _ in range(k)] for k in lens]


def make_engine(
    model_dir: Path,
    page_size: int = 16,
    chunk: int = 0,
    tp: int = 1,
    pages: int = 256,
    max_prefill_tokens: int = 16384,
    radix_cache: bool = False,
    **kw,
) -> Engine:
    """An engine on the tiny model; the prefix cache is off unless asked for, so page counts
    are exact (tests/integration/test_prefix_cache.py covers the cache)."""
    cfg = ServerConfig(
        model_path=str(model_dir),
        tp_size=tp,
        cache=CacheConfig(page_size=page_size, num_pages=pages, radix_cache=radix_cache),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=max_prefill_tokens),
    )
    return Engine(cfg, **kw)


def output_ids(engine: Engine, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r["output_ids"] for r in engine.generate(ps, params)]


def one_at_a_time(engine: Engine, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output_ids(engine, [p], params)[0] for p in ps]


def reference_outputs(model_dir: Path, ps: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of each prompt alone on a fresh TP 1 engine (whole prefill, page size 16)."""
    eng = make_engine(model_dir)
    try:
        return one_at_a_time(eng, ps)
    finally:
        eng.shutdown()
