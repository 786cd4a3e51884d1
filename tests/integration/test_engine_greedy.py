"""Greedy outputs do not depend on batching, chunking, page size or layer groups."""

import pytest

from tests.helpers.engine import make_engine, one_at_a_time, output_ids, prompts
from tests.helpers.recording_connector import RecordingConnector

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


def test_outputs_are_not_trivial(reference):
    assert all(len(o) == 10 for o in reference)
    assert len({tuple(o) for o in reference}) == len(reference)


def test_batched_equals_one_at_a_time(tiny_model_dir, reference):
    eng = make_engine(tiny_model_dir)
    try:
        assert output_ids(eng, PROMPTS) == reference
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


@pytest.mark.parametrize("chunk", [7, 33, 64, 100])
def test_chunked_prefill_equals_whole(tiny_model_dir, reference, chunk):
    eng = make_engine(tiny_model_dir, chunk=chunk)
    try:
        assert output_ids(eng, PROMPTS) == reference
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_size_does_not_change_outputs(tiny_model_dir, reference, page_size):
    eng = make_engine(tiny_model_dir, page_size=page_size, pages=4096 // page_size, chunk=33)
    try:
        assert output_ids(eng, PROMPTS) == reference
    finally:
        eng.shutdown()


def test_layer_groups_equal_one_pass(tiny_model_dir, reference):
    eng = make_engine(tiny_model_dir, chunk=64, layer_groups=3)
    try:
        assert output_ids(eng, PROMPTS) == reference
    finally:
        eng.shutdown()


def test_connector_plans_groups_per_batch(tiny_model_dir, reference):
    """The connector chooses each prefill batch's split; its worker hears every group with the
    plan's meta; decode steps run in one pass with no meta."""
    conn = RecordingConnector(groups=lambda b: 3 if b.num_tokens > 100 else 1)
    eng = make_engine(tiny_model_dir, chunk=0, connector=conn)
    try:
        assert one_at_a_time(eng, PROMPTS) == reference
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
        assert output_ids(eng, PROMPTS) == reference
        assert eng.allocator.num_free == 12
    finally:
        eng.shutdown()
