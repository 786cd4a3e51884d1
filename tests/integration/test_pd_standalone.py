"""PD with a STANDALONE draft model on both sides (in process, local backend; disagg/draft_transfer.py):
the prefill runs the draft over the prompt (chunk by chunk) and sends its KV after the target's
layers, so the decode's draft book holds the whole prompt when the KV lands and its first step
drafts at once. Greedy outputs equal the colocated engine's without speculation; the drafts proposed
and accepted at every step equal a colocated STANDALONE engine's for the same request (what shows
the draft state arrived: a draft equal to the target accepts every draft either way, a noisy
copy of it does not); the bytes written are the target's KV plus the draft's; injected transfer
failures and aborts leave no draft page on either side; and a negative control: draft KV lost on
arrival keeps the outputs but not the first step's acceptance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from tests.helpers.draft_models import noisy_copy
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.pd_pair import PS, Pair, assert_pd_matches, failures_then_decode_abort, make_pair, prompts
from tests.helpers.pd_parity import expected_bytes
from tests.helpers.pd_stack import generate, greedy, start_stack
from tests.helpers.tolerance import Generation, Route, assert_same_generations

GREEDY24 = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
LENS = [17, 40, 70]  # inside a page, across pages, across chunks of 24


def standalone(draft: Path) -> SpeculativeConfig:
    return SpeculativeConfig("STANDALONE", num_steps=3, draft_model_path=str(draft))


@pytest.fixture(scope="module")
def noisy_draft(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return noisy_copy(tiny_model_dir, tmp_path_factory.mktemp("noisy") / "draft")


def colocated_steps(model_dir: Path, spec: SpeculativeConfig, ps: list[list[int]]) -> list[list]:
    return colocated_spec_steps(model_dir, spec, ps, GREEDY24, PS)


def assert_draft_pool_free(engine: Engine) -> None:
    draft = engine.draft
    assert draft is not None and not draft.book.seqs, None if draft is None else list(draft.book.seqs)
    assert draft.book.allocator.num_free == draft.book.allocator.num_pages


def draft_book_at_landing(landed: dict[str, list[int]]):
    """Pair.run's on_landed: what the decode's draft book holds for the request when its KV landed."""

    def keep(pair: Pair, d: Req) -> None:
        draft = pair.decode.draft
        assert draft is not None
        seq = draft.book.seqs.get(d.rid)
        landed[d.rid] = [] if seq is None else list(seq.tokens)

    return keep


def run_and_check(pair: Pair, ps: list[list[int]], reference, draft: Path, model_dir: Path) -> list[Req]:
    """Every prompt through the pair: outputs as colocated, the draft KV of the whole prompt held by
    the decode's draft book when the KV landed, the bytes of both models' KV (the target's past the
    prefix the decode's radix cache held, the draft's whole); both sides free."""
    landed: dict[str, list[int]] = {}
    before = pair.prefill.stats()["disaggregation"]["bytes_written"]
    reqs = [pair.reqs(ids, GREEDY24) for ids in ps]
    pair.run(reqs, timeout_s=120.0, on_landed=draft_book_at_landing(landed))
    decoded = [d for _, d in reqs]
    assert all(d.finish_reason is FinishReason.LENGTH for d in decoded), [d.finish_detail for d in decoded]
    assert_pd_matches(decoded, ps, reference, "PD, STANDALONE on both sides vs colocated")
    assert [landed[d.rid] for d in decoded] == ps  # nothing of the prompt is recomputed on the decode
    lens, held = [len(p) for p in ps], [d.timeline.prefix_hit_tokens for d in decoded]  # whole pages
    target_kv = expected_bytes(model_dir, lens, PS, 1, 1) - expected_bytes(model_dir, held, PS, 1, 1)
    draft_kv = expected_bytes(draft, lens, PS, 1, 1)
    assert pair.prefill.stats()["disaggregation"]["bytes_written"] - before == target_kv + draft_kv
    pair.settle()
    assert_draft_pool_free(pair.prefill)
    assert_draft_pool_free(pair.decode)
    return decoded


@pytest.mark.parametrize("groups", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_draft_equal_to_target_accepts_every_draft_from_the_first_step(tiny_model_dir: Path, reference, groups):
    """Chunked prefill (24 tokens), the draft KV sent with each chunk, or as its own last layer group
    after 3 target groups (the fast suite runs that one; the others send chunks whole)."""
    ps = prompts(21, LENS)
    spec = standalone(tiny_model_dir)
    with make_pair(tiny_model_dir, 24, prefill_speculative=spec, decode_speculative=spec, layer_groups=groups) as pair:
        decoded = run_and_check(pair, ps, reference, tiny_model_dir, tiny_model_dir)
        if groups > 1:
            assert pair.pipeline is not None and pair.pipeline.counters.batches_by_groups.get(groups, 0) > 0
    steps = [d.spec.steps for d in decoded if d.spec is not None]
    assert len(steps) == len(ps) and all(len(s[0][0]) == s[0][1] == 3 for s in steps)  # all 3 at once
    assert all(a == len(drafts) for s in steps for drafts, a in s)
    assert steps == colocated_steps(tiny_model_dir, spec, ps)


def test_negative_control_draft_kv_lost_on_arrival(tiny_model_dir: Path, reference):
    """What the per-step checks catch: the decode's draft KV zeroed as it lands (the draft book
    still takes it as written, like a placeholder) keeps the outputs (verification) but a draft
    equal to the target no longer has all its drafts accepted at the first step."""
    ps = prompts(24, [40])
    spec = standalone(tiny_model_dir)

    def zero_draft_kv(pair: Pair, d: Req) -> None:
        draft = pair.decode.draft
        assert draft is not None and d.draft_pages.size
        idx = torch.as_tensor(d.draft_pages)
        for t in (*draft.runner.pool.k, *draft.runner.pool.v):
            t[idx] = 0

    with make_pair(tiny_model_dir, 24, prefill_speculative=spec, decode_speculative=spec) as pair:
        reqs = [pair.reqs(ids, GREEDY24) for ids in ps]
        pair.run(reqs, timeout_s=120.0, on_landed=zero_draft_kv)
        decoded = [d for _, d in reqs]
        assert_pd_matches(decoded, ps, reference, "PD, draft KV zeroed on arrival")
        first = decoded[0].spec.steps[0] if decoded[0].spec is not None else None
        assert first is not None and first[1] < len(first[0]) == 3, first
        pair.settle()


@pytest.mark.slow  # two rounds of three prompts and a colocated run: test_draft_equal_to_target_... is its sibling
def test_other_draft_proposes_what_it_proposes_colocated(tiny_model_dir: Path, noisy_draft: Path, reference):
    """A noisy copy of the target as draft (chains accepted in part): every step's drafts and
    accepted count equal a colocated STANDALONE engine's, also the second time, when the prefill
    took the prompts' target KV from its prefix cache and the decode held their prefix in its own
    (the draft's KV is still computed and sent whole: neither side caches it)."""
    ps = prompts(22, LENS)
    spec = standalone(noisy_draft)
    want = colocated_steps(tiny_model_dir, spec, ps)
    with make_pair(
        tiny_model_dir, 24, prefill_speculative=spec, decode_speculative=spec, decode_radix_cache=True
    ) as pair:
        for round_ in range(2):
            decoded = run_and_check(pair, ps, reference, noisy_draft, tiny_model_dir)
            assert [d.spec.steps for d in decoded if d.spec is not None] == want, f"round {round_}"
            # the prefill's cached prompt tokens (aux data): none the first time, whole pages the second
            assert (sum(d.cached_tokens for d in decoded) > 0) == (round_ == 1), [d.cached_tokens for d in decoded]
            assert (sum(d.timeline.prefix_hit_tokens for d in decoded) > 0) == (round_ == 1)  # the decode's
    proposed = sum(len(drafts) for s in want for drafts, _ in s)
    accepted = sum(a for s in want for _, a in s)
    assert 0 < accepted < proposed, (accepted, proposed)


def test_failures_and_aborts_free_draft_pages_on_both_sides(tiny_model_dir: Path, reference):
    spec = standalone(tiny_model_dir)

    def check_free(pair: Pair) -> None:
        assert_draft_pool_free(pair.prefill)
        assert_draft_pool_free(pair.decode)

    failures_then_decode_abort(tiny_model_dir, reference, check_free, prefill_speculative=spec, decode_speculative=spec)


def test_standalone_pd_through_router(tiny_model_dir: Path, tmp_path: Path, reference):
    """prefill and decode both with the target as draft (Mooncake over loopback, sglang-router):
    the router's answers are the colocated tokens and logprobs, every draft is accepted, and the
    prefill wrote twice the target's KV (the draft's pages after the target's)."""
    pytest.importorskip("mooncake.engine")
    ps = prompts(23, LENS)
    draft = ("--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3")
    draft += ("--speculative-draft-model-path", str(tiny_model_dir))
    stack = start_stack(
        tiny_model_dir,
        tmp_path,
        "--page-size",
        str(PS),
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        "24",
        prefill_args=draft,
        decode_args=draft,
    )
    try:
        outs = [
            generate(stack.router, {"input_ids": p, "sampling_params": greedy(24), "return_logprob": True}) for p in ps
        ]
        want = [reference(p, GREEDY24) for p in ps]
        assert_same_generations([Generation.of(o) for o in outs], want, Route.ACROSS_PROCESSES, ps, "PD STANDALONE")
        metas = [o["meta_info"] for o in outs]
        assert all(m["spec_accept_token_num"] == m["spec_draft_token_num"] == 17 for m in metas), metas
        stack.decode.wait_idle()
        p = stack.prefill.wait_idle()
        assert p["disaggregation"]["bytes_written"] == 2 * expected_bytes(tiny_model_dir, LENS, PS, 1, 1)
    except AssertionError:
        print(stack.logs())
        raise
    finally:
        stack.close()
