"""The MoE presets through the engine: batching, chunked prefill and TP 2 keep greedy outputs
(tokens and logprobs), which depend on the context."""

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.engine import assert_context_matters, assert_engine_matches, make_engine, prompts, reference_outputs
from tests.helpers.tolerance import Route

PROMPTS = prompts(4, vocab=290)


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-minimax-m2"])
def moe_model(request, tmp_path_factory):
    path = write_preset(request.param, tmp_path_factory.mktemp(request.param))
    return path, reference_outputs(path, PROMPTS)


def test_outputs_depend_on_the_context(moe_model):
    path, reference = moe_model
    eng = make_engine(path)
    try:
        assert_context_matters(eng, PROMPTS[1:], reference[1:])  # the 1-token prompt has no context
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp, chunk", [(1, 0), (1, 7), (2, 33)])
def test_batched_chunked_and_tp_equal_one_at_a_time(moe_model, tp, chunk):
    path, reference = moe_model
    eng = make_engine(path, tp=tp, chunk=chunk)
    try:
        assert_engine_matches(eng, PROMPTS, reference, Route.ACROSS_PROCESSES if tp > 1 else Route.SAME_PROCESS)
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()
