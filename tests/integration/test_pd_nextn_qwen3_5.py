"""PD with NEXTN on both sides on Qwen3.5 (tiny-qwen3.5's mtp.* layer, TP (1,1); in process,
local backend; disagg/mtp_transfer.py): the prefill runs the MTP layer over the prompt chunk by
chunk and sends its one-layer K/V after the target's layers (the last layer group, after the
target's full-attention KV and its recurrent state, which moves as without NEXTN) and the target's
last hidden state in the aux data. Greedy outputs equal the colocated engine's; the drafts
proposed and accepted at every step equal a colocated NEXTN engine's for the same request (what
shows the MTP state arrived), layer-pipelined (a group with no full-attention layer sends state
only) and behind cached prefixes on both sides; the bytes written are the target's KV, its state
and the MTP's KV; an MTP layer that predicts the target has every draft accepted from the first
step; a landed MTP KV zeroed keeps the outputs but not the first step's drafts; injected failures
and aborts leave no page, state slot or MTP state on either side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpipe.engine.request import Req
from kvpipe.model.presets import write_preset
from tests.helpers import nextn
from tests.helpers.draft_models import bigram_copy
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.nextn import GREEDY16, LENS, NEXTN, assert_no_mtp_state, check_through_router, mtp_kv_bytes
from tests.helpers.pd_pair import (
    PS,
    Pair,
    Reference,
    assert_pd_matches,
    colocated_greedy,
    failures_then_decode_abort,
    make_pair,
    prompts,
)
from tests.helpers.tolerance import Route


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset("tiny-qwen3.5", tmp_path_factory.mktemp("tiny_qwen35_pd_nextn"))


@pytest.fixture(scope="module")
def bigram(qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bigram_copy(qwen, tmp_path_factory.mktemp("bigram") / "m")


@pytest.fixture(scope="module")
def reference(qwen: Path) -> Iterator[Reference]:
    yield from colocated_greedy(qwen)


@pytest.fixture(scope="module")
def bigram_reference(bigram: Path) -> Iterator[Reference]:
    yield from colocated_greedy(bigram)


def assert_all_free(pair: Pair) -> None:
    for eng in (pair.prefill, pair.decode):
        assert_no_mtp_state(eng)
        assert eng.state_slots is not None and eng.state_slots.in_use() == {}


def run_and_check(pair: Pair, ps: list[list[int]], reference: Reference, model_dir: Path) -> list[Req]:
    return nextn.run_and_check(
        pair,
        ps,
        reference,
        model_dir,
        lambda lens: mtp_kv_bytes(model_dir, lens, PS),
        "PD, NEXTN on both sides (Qwen3.5) vs colocated",
        check_free=assert_all_free,
    )


@pytest.mark.parametrize("rounds", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_drafts_and_accepted_counts_as_colocated(qwen: Path, reference, rounds: int):
    """Layer-pipelined (2 target groups: the first holds only delta-net layers, state and no KV;
    the MTP layer its own last group), chunked prefill (24); a second round (the full sweep)
    finds the prompts in both sides' prefix caches (the decode's: the MTP KV of its prefix came
    with its pages, only the rest moves). The fast suite runs one round of the two longer prompts."""
    ps = prompts(22, LENS) if rounds > 1 else prompts(22, LENS)[1:]
    want = colocated_spec_steps(qwen, NEXTN, ps, GREEDY16, PS, 24)
    with make_pair(
        qwen, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN, decode_radix_cache=True, layer_groups=2
    ) as pair:
        for round_ in range(rounds):
            decoded = run_and_check(pair, ps, reference, qwen)
            assert [d.spec.steps for d in decoded if d.spec is not None] == want, f"round {round_}"
            assert all(len(d.spec.steps[0][0]) == 3 for d in decoded if d.spec is not None)  # drafts at once
            assert (sum(d.timeline.prefix_hit_tokens for d in decoded) > 0) == (round_ == 1)  # the decode's
        assert pair.pipeline is not None and pair.pipeline.counters.batches_by_groups.get(2, 0) > 0


def test_an_mtp_layer_that_predicts_the_target_accepts_every_draft_from_the_first_step(bigram: Path, bigram_reference):
    ps = prompts(21, LENS)
    with make_pair(bigram, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN) as pair:
        decoded = run_and_check(pair, ps, bigram_reference, bigram)
    steps = [d.spec.steps for d in decoded if d.spec is not None]
    assert len(steps) == len(ps) and all(len(s[0][0]) == s[0][1] == 3 for s in steps)  # all 3 at once
    assert all(a == len(drafts) for s in steps for drafts, a in s)


def test_negative_control_landed_mtp_kv_zeroed(qwen: Path, reference):
    """What the per-step checks catch: the decode's landed MTP KV zeroed before its first step
    keeps the outputs (verification) but not the first step's drafts."""
    ps = prompts(24, [40])
    want = colocated_spec_steps(qwen, NEXTN, ps, GREEDY16, PS, 24)

    def zero(pair: Pair, d: Req) -> None:
        mtp = pair.decode.mtp
        assert mtp is not None and d.draft_pages.size
        pages = torch.as_tensor(d.draft_pages)
        mtp.pool.k[0][pages] = 0
        mtp.pool.v[0][pages] = 0

    with make_pair(qwen, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN) as pair:
        reqs = [pair.reqs(ids, GREEDY16) for ids in ps]
        pair.run(reqs, timeout_s=120.0, on_landed=zero)
        decoded = [d for _, d in reqs]
        assert_pd_matches(decoded, ps, reference, "PD, MTP KV zeroed on arrival")
        first = [d.spec.steps[0] for d in decoded if d.spec is not None]
        assert len(first) == len(ps) and all(f != w[0] for f, w in zip(first, want)), (first, want)
        pair.settle()


def test_failures_and_aborts_free_every_page_state_and_mtp_state_on_both_sides(qwen: Path, reference):
    failures_then_decode_abort(qwen, reference, assert_all_free, prefill_speculative=NEXTN, decode_speculative=NEXTN)


@pytest.mark.slow  # two servers and sglang-router (38 s here, more under load); in-process sibling above
def test_nextn_pd_through_router(bigram: Path, bigram_reference, tmp_path: Path):
    """prefill and decode both with NEXTN on tiny-qwen3.5's bigram copy (Mooncake over loopback,
    sglang-router): the router's answers are the colocated tokens and logprobs, every draft is
    accepted from the first step (17 drafts in 23 tokens after the prefill's, 3 + 1 a step), and
    the prefill wrote the target's KV and state plus the MTP layer's KV."""
    nextn_flags = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")
    kv = mtp_kv_bytes(bigram, LENS, PS)
    check_through_router(bigram, tmp_path, nextn_flags, bigram_reference, kv, "PD NEXTN Qwen3.5")


@pytest.mark.slow  # two TP engines with their children (~30-60 s on 2 loaded cores)
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["tp2-tp1", "tp1-tp2"])
def test_drafts_as_colocated_with_tp_on_either_side(qwen: Path, reference, p_tp: int, d_tp: int):
    """The MTP layer and its K/V whole on TP rank 0 of each side (disagg/mtp_transfer.py's
    MTP_RANK), the target's KV and recurrent state head-sliced: outputs, every step's drafts and
    accepted counts as a colocated TP 1 NEXTN engine's, the first step drafting at once; both
    sides free every page, state slot and MTP state."""
    ps = prompts(22, LENS)[1:]
    want = colocated_spec_steps(qwen, NEXTN, ps, GREEDY16, PS, 24)
    with make_pair(
        qwen, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN, layer_groups=2, prefill_tp=p_tp, decode_tp=d_tp
    ) as pair:
        reqs = [pair.reqs(ids, GREEDY16) for ids in ps]
        pair.run(reqs, timeout_s=180.0)
        decoded = [d for _, d in reqs]
        assert_pd_matches(
            decoded, ps, reference, f"PD NEXTN (Qwen3.5) at TP ({p_tp},{d_tp}) vs colocated", Route.ACROSS_PROCESSES
        )
        assert [d.spec.steps for d in decoded if d.spec is not None] == want
        assert all(len(d.spec.steps[0][0]) == 3 for d in decoded if d.spec is not None)  # drafts at once
        pair.settle()
        for eng in (pair.prefill, pair.decode):
            assert_no_mtp_state(eng)
