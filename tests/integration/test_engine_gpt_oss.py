"""tiny-gpt-oss through the engine: batching, chunked prefill (chunks that cut the sliding
window of 32 and the pages of 16) and TP 2 keep the greedy tokens of one request at a time.
The prompts run to 150 tokens, so the sliding layers' windows move."""

import pytest

from kvpipe.model.presets import write_preset

from engine_utils import make_engine, output_ids, prompts, reference_outputs

PROMPTS = prompts(6, vocab=290)


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory):
    path = write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny-gpt-oss"))
    return path, reference_outputs(path, PROMPTS)


def test_outputs_are_not_trivial(gpt_oss_model):
    _, reference = gpt_oss_model
    assert max(len(p) for p in PROMPTS) > 4 * 32
    assert len({tuple(o) for o in reference}) == len(reference)


@pytest.mark.parametrize("tp, chunk", [(1, 0), (1, 7), (1, 40), (2, 33)])
def test_batched_chunked_and_tp_equal_one_at_a_time(gpt_oss_model, tp, chunk):
    path, reference = gpt_oss_model
    eng = make_engine(path, tp=tp, chunk=chunk)
    try:
        assert output_ids(eng, PROMPTS) == reference
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


def test_prefix_cache_hits_keep_outputs(gpt_oss_model):
    """Requests behind a cached prefix (every page is kept, sliding layers included) attend from
    the cache through the window."""
    path, reference = gpt_oss_model
    eng = make_engine(path, radix_cache=True)
    try:
        assert output_ids(eng, PROMPTS) == reference
        assert output_ids(eng, PROMPTS) == reference  # now from the cache
    finally:
        eng.shutdown()
