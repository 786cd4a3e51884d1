"""Greedy outputs (tokens and logprobs) do not depend on batching, chunking, page size or layer
groups; the comparison catches one corrupted KV page (negative control)."""

import pytest

from kvpipe.engine.batch import ForwardMode
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.engine import (
    assert_context_matters,
    assert_engine_matches,
    generate_after_prefill,
    make_engine,
    one_at_a_time,
    prompts,
)
from tests.helpers.recording_connector import RecordingConnector
from tests.helpers.tolerance import Route, assert_same_generations

PROMPTS = prompts()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone, whole prefill, page size 16."""
    eng = make_engine(tiny_model_dir)
    try:
        ref = one_at_a_time(eng, PROMPTS)
        assert eng.allocator.num_free == eng.allocator.num_pages
        return ref
    finally:
        eng.shutdown()


def test_outputs_depend_on_the_context(tiny_model_dir, reference):
    """The same last token after other earlier tokens gives other outputs: the comparisons below
    would see a wrong KV page of the earlier tokens."""
    assert all(len(o.tokens) == len(o.logprobs) == 10 for o in reference)
    eng = make_engine(tiny_model_dir)
    try:
        assert_context_matters(eng, PROMPTS[1:], reference[1:])  # the 1-token prompt has no context
    finally:
        eng.shutdown()


def test_a_corrupted_page_fails_the_check(tiny_model_dir, reference):
    """Negative control: one page of one layer overwritten after the prefill makes the comparison
    fail on exactly that prompt; untouched, the same run passes."""
    eng = make_engine(tiny_model_dir)
    try:
        got = generate_after_prefill(eng, PROMPTS, lambda e, req, i: None)
        assert_same_generations(got, reference, Route.SAME_PROCESS, PROMPTS)
        hit = KVCorruption(layer=1, page=1)  # prompt 3 (64 tokens): its second page
        got = generate_after_prefill(eng, PROMPTS, lambda e, req, i: i == 3 and hit.apply(e.runner.pool, req.pages))
        with pytest.raises(
            AssertionError, match=r"same process and TP: prompt 3 \(64 tokens\): [^\n]*position [1-9][^\n]*\Z"
        ):
            assert_same_generations(got, reference, Route.SAME_PROCESS, PROMPTS)
    finally:
        eng.shutdown()


def test_batched_equals_one_at_a_time(tiny_model_dir, reference):
    eng = make_engine(tiny_model_dir)
    try:
        assert_engine_matches(eng, PROMPTS, reference)
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


@pytest.mark.parametrize("chunk", [7, 33, 64, 100])
def test_chunked_prefill_equals_whole(tiny_model_dir, reference, chunk):
    eng = make_engine(tiny_model_dir, chunk=chunk)
    try:
        assert_engine_matches(eng, PROMPTS, reference)
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


@pytest.mark.parametrize("chunk", [7, 33])
def test_mixed_chunk_equals_whole(tiny_model_dir, reference, chunk):
    """--enable-mixed-chunk: decode rows go through the prefill forward beside prompt chunks."""
    eng = make_engine(tiny_model_dir, chunk=chunk, mixed_chunk=True)
    modes = []
    schedule = eng.scheduler.schedule

    def recorded():
        batch = schedule()
        if batch is not None:
            modes.append(batch.mode)
        return batch

    eng.scheduler.schedule = recorded
    try:
        assert_engine_matches(eng, PROMPTS, reference)
        assert ForwardMode.MIXED in modes  # the case under test happened
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_size_does_not_change_outputs(tiny_model_dir, reference, page_size):
    eng = make_engine(tiny_model_dir, page_size=page_size, pages=4096 // page_size, chunk=33)
    try:
        assert_engine_matches(eng, PROMPTS, reference)
    finally:
        eng.shutdown()


def test_layer_groups_equal_one_pass(tiny_model_dir, reference):
    eng = make_engine(tiny_model_dir, chunk=64, layer_groups=3)
    try:
        assert_engine_matches(eng, PROMPTS, reference)
    finally:
        eng.shutdown()


def test_connector_plans_groups_per_batch(tiny_model_dir, reference):
    """The connector chooses each prefill batch's split; its worker hears every group with the
    plan's meta; decode steps run in one pass with no meta."""
    conn = RecordingConnector(groups=lambda b: 3 if b.num_tokens > 100 else 1)
    eng = make_engine(tiny_model_dir, chunk=0, connector=conn)
    try:
        assert_same_generations(one_at_a_time(eng, PROMPTS), reference, Route.SAME_PROCESS, PROMPTS)
        assert conn.worker is not None
        prefill = [(meta[1], s, e) for meta, s, e in conn.worker.groups if meta is not None]
        want = []
        for n in (len(p) for p in PROMPTS):
            want += [(n, 0, 1), (n, 1, 3), (n, 3, 4)] if n > 100 else [(n, 0, 4)]
        assert prefill == want
        assert {(s, e) for meta, s, e in conn.worker.groups if meta is None} == {(0, 4)}
    finally:
        eng.shutdown()


def test_queueing_under_page_pressure(tiny_model_dir, reference):
    # 12 pages of 16 tokens: the 150-token prompt (+9) needs 10, so requests mostly run one by one
    eng = make_engine(tiny_model_dir, pages=12, chunk=33)
    try:
        assert_engine_matches(eng, PROMPTS, reference)
        assert eng.allocator.num_free == 12
    finally:
        eng.shutdown()
