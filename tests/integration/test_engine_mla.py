"""The engine on the tiny-deepseek-v3 preset (MLA over a latent paged cache, MoE): greedy outputs
(tokens and logprobs) do not depend on batching, chunking, page size, layer groups, prefix-cache
hits or TP, and they depend on the context (a wrong latent page would show)."""

from __future__ import annotations

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.engine import (
    GREEDY,
    assert_context_matters,
    assert_engine_matches,
    generations,
    make_engine,
    one_at_a_time,
    prompts,
)
from tests.helpers.tolerance import Generation, Route, assert_same_generations

PROMPTS = prompts()


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return write_preset("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))


@pytest.fixture(scope="module")
def reference(deepseek_dir):
    """Each prompt alone, whole prefill, page size 16."""
    eng = make_engine(deepseek_dir)
    try:
        assert eng.runner.pool.latent and eng.runner.pool.v == []
        ref = one_at_a_time(eng, PROMPTS)
        assert_context_matters(eng, PROMPTS[1:], ref[1:])  # the 1-token prompt has no context
        return ref
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "kw",
    [dict(chunk=7), dict(chunk=33, page_size=1, pages=4096), dict(chunk=64, layer_groups=3), dict(chunk=33, tp=2)],
    ids=["batched_chunk7", "page1", "layer_groups", "tp2"],
)
def test_batched_chunked_paged_tp_equal_reference(deepseek_dir, reference, kw):
    eng = make_engine(deepseek_dir, **kw)
    try:
        route = Route.ACROSS_PROCESSES if kw.get("tp", 1) > 1 else Route.SAME_PROCESS
        assert_engine_matches(eng, PROMPTS, reference, route)
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


def test_prefix_cache_hits_read_the_latent(deepseek_dir, reference):
    """Prompts that extend finished ones start behind cached latent pages (the prefix path); each
    prompt gets its own suffix, so every output depends on its own cached prefix."""
    longer = [p + [5 + i, 60 + 7 * i, 7] for i, p in enumerate(PROMPTS)]
    cold = make_engine(deepseek_dir, chunk=33)
    try:
        want = generations(cold, longer)
    finally:
        cold.shutdown()
    eng = make_engine(deepseek_dir, chunk=33, radix_cache=True)
    try:
        assert_engine_matches(eng, PROMPTS, reference)
        results = eng.generate(longer, GREEDY)
        assert_same_generations([Generation.of(r) for r in results], want, Route.SAME_PROCESS, longer, "cache hits")
        assert sum(r["meta_info"]["cached_tokens"] for r in results) > 0
    finally:
        eng.shutdown()
