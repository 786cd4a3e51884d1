"""tiny-gpt-oss through the engine: batching, chunked prefill (chunks that cut the sliding
window of 32 and the pages of 16) and TP 2 keep the greedy tokens and logprobs of one request at
a time, which depend on the context. The prompts run to 150 tokens, so the sliding layers'
windows move."""

import pytest

from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_page_bound
from kvpipe.engine.request import Req, SamplingParams
from kvpipe.model.presets import write_preset
from tests.helpers.engine import (
    GREEDY,
    assert_context_matters,
    assert_engine_matches,
    make_engine,
    output_ids,
    prompts,
    reference_outputs,
)
from tests.helpers.tolerance import Route

PROMPTS = prompts(6, vocab=290)


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory):
    path = write_preset("tiny-gpt-oss", tmp_path_factory.mktemp("tiny-gpt-oss"))
    return path, reference_outputs(path, PROMPTS)


def test_outputs_depend_on_the_context(gpt_oss_model):
    path, reference = gpt_oss_model
    assert max(len(p) for p in PROMPTS) > 4 * 32
    eng = make_engine(path)
    try:
        assert_context_matters(eng, PROMPTS[1:], reference[1:])  # the 1-token prompt has no context
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp, chunk", [(1, 0), (1, 7), (1, 40), (2, 33)])
def test_batched_chunked_and_tp_equal_one_at_a_time(gpt_oss_model, tp, chunk):
    path, reference = gpt_oss_model
    eng = make_engine(path, tp=tp, chunk=chunk)
    try:
        assert_engine_matches(eng, PROMPTS, reference, Route.ACROSS_PROCESSES if tp > 1 else Route.SAME_PROCESS)
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()


def test_prefix_cache_keeps_window_pages(gpt_oss_model):
    """The sliding layers free the pages their window slid past, so the engine's radix cache is
    the sliding-window one (window pages only where a hit may start; its own tests in
    test_engine_gpt_oss_prefix_cache.py) and outputs stay exact."""
    path, reference = gpt_oss_model
    eng = make_engine(path, radix_cache=True)
    try:
        assert isinstance(eng.prefix_cache, SWARadixCache) and eng.prefix_cache.window == 32
        assert_engine_matches(eng, PROMPTS, reference)
    finally:
        eng.shutdown()


def test_engine_equals_hf_generate_past_the_window(gpt_oss_model):
    """The engine (window pages on, chunks of 7 over pages of 4) against HF's generate: the
    sliding layers' pages are freed as they slide out and the tokens do not change."""
    path, _ = gpt_oss_model
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompt, n = PROMPTS[-1], 48
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)[
            0, len(prompt) :
        ].tolist()
    eng = make_engine(path, page_size=4, chunk=7, pages=128)
    try:
        got = output_ids(eng, [prompt], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()
    assert got == want


def test_sliding_pages_stay_bounded_over_a_long_generation(gpt_oss_model):
    """Full layers keep a page per 4 tokens; the sliding layers hold at most the window's pages
    (window 32 over pages of 4: <= 10 with a chunk of 7), step after step, while 240 tokens are
    generated; every page comes back at the end."""
    path, _ = gpt_oss_model
    eng = make_engine(path, page_size=4, chunk=7, pages=128)
    bound = eng.scheduler.window_pages(Req("x", PROMPTS[3], GREEDY))
    assert bound == window_page_bound(32, 7, 4) == 11
    eng.add_request(Req("long", PROMPTS[3], SamplingParams(max_new_tokens=240, temperature=0.0, ignore_eos=True)))
    held, steps = [], 0
    try:
        while eng.has_work() and steps < 2000:
            eng.step()
            steps += 1
            for r in eng.scheduler.running:
                swa = int((r.swa_pages >= 0).sum())
                held.append(swa)
                assert swa <= bound
                # pages in use: the full layers' table plus the live window pages, nothing else
                assert eng.allocator.num_used == len(r.pages) + swa
                first = max(0, r.num_cached - 32 + 1) // 4
                assert (r.swa_pages[:first] < 0).all() and (r.swa_pages[first:] >= 0).all()
        assert not eng.has_work()
        assert eng.allocator.num_free == eng.allocator.num_pages
    finally:
        eng.shutdown()
    assert len(held) > 240 and max(held) <= 10 and min(held[-100:]) >= 8
