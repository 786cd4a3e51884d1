"""The MoE presets through the engine: batching, chunked prefill and TP 2 keep greedy outputs."""

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.engine import make_engine, output_ids, prompts, reference_outputs

PROMPTS = prompts(4, vocab=290)


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-minimax-m2"])
def moe_model(request, tmp_path_factory):
    path = write_preset(request.param, tmp_path_factory.mktemp(request.param))
    return path, reference_outputs(path, PROMPTS)


def test_outputs_are_not_trivial(moe_model):
    _, reference = moe_model
    assert len({tuple(o) for o in reference}) == len(reference)


@pytest.mark.parametrize("tp, chunk", [(1, 0), (1, 7), (2, 33)])
def test_batched_chunked_and_tp_equal_one_at_a_time(moe_model, tp, chunk):
    path, reference = moe_model
    eng = make_engine(path, tp=tp, chunk=chunk)
    try:
        assert output_ids(eng, PROMPTS) == reference
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()
