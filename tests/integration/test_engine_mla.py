"""The engine on the tiny-deepseek-v3 preset (MLA over a latent paged cache, MoE): greedy outputs
do not depend on batching, chunking, page size, layer groups, prefix-cache hits or TP."""

from __future__ import annotations

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.engine import GREEDY, make_engine, one_at_a_time, output_ids, prompts

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
        return one_at_a_time(eng, PROMPTS)
    finally:
        eng.shutdown()


def test_outputs_are_not_trivial(reference):
    assert len({tuple(o) for o in reference}) == len(reference)


@pytest.mark.parametrize(
    "kw",
    [dict(chunk=7), dict(chunk=33, page_size=1, pages=4096), dict(chunk=64, layer_groups=3), dict(chunk=33, tp=2)],
    ids=["batched_chunk7", "page1", "layer_groups", "tp2"],
)
def test_batched_chunked_paged_tp_equal_reference(deepseek_dir, reference, kw):
    eng = make_engine(deepseek_dir, **kw)
    try:
        assert output_ids(eng, PROMPTS) == reference
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


def test_prefix_cache_hits_read_the_latent(deepseek_dir, reference):
    """Prompts that extend finished ones start behind cached latent pages (the prefix path)."""
    longer = [p + [5, 6, 7] for p in PROMPTS]
    cold = make_engine(deepseek_dir, chunk=33)
    try:
        want = output_ids(cold, longer)
    finally:
        cold.shutdown()
    eng = make_engine(deepseek_dir, chunk=33, radix_cache=True)
    try:
        assert output_ids(eng, PROMPTS) == reference
        results = eng.generate(longer, GREEDY)
        assert [r["output_ids"] for r in results] == want
        assert sum(r["meta_info"]["cached_tokens"] for r in results) > 0
    finally:
        eng.shutdown()
