"""PD with NEXTN on both sides (tiny-deepseek-v3's MTP layer; in process, local backend;
disagg/mtp_transfer.py): the prefill runs the MTP layer over the prompt chunk by chunk and sends
its one-layer latent KV after the target's layers (the last layer group) and the target's last
hidden state in the aux data, so the decode's MTP state holds the prompt when the KV lands and its
first step drafts at once. Greedy outputs equal the colocated engine's; the drafts proposed and
accepted at every step equal a colocated NEXTN engine's for the same request, also behind cached
prefixes on both sides (what shows the MTP state arrived); an MTP layer that predicts the target
has every draft accepted from the first step; the bytes written are the target's KV plus the
MTP's, and the aux carries one hidden row; a negative control (the landed MTP KV or hidden state
zeroed) keeps the outputs but not the first step's drafts; injected failures and aborts leave
no page and no MTP state on either side; a NEXTN server on one side only is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpipe.engine.request import FinishReason, Req
from kvpipe.model.presets import write_preset
from kvpipe.transfer.control.handshake import REFUSED
from tests.helpers import nextn
from tests.helpers.draft_models import bigram_copy
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.nextn import GREEDY16, LENS, NEXTN, check_through_router, mtp_kv_bytes, no_mtp_state_on_either_side
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

Steps = list[list[tuple[tuple[int, ...], int]]]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))


@pytest.fixture(scope="module")
def bigram(deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bigram_copy(deepseek, tmp_path_factory.mktemp("bigram") / "m")


@pytest.fixture(scope="module")
def ds_reference(deepseek: Path) -> Iterator[Reference]:
    yield from colocated_greedy(deepseek)


@pytest.fixture(scope="module")
def bigram_reference(bigram: Path) -> Iterator[Reference]:
    yield from colocated_greedy(bigram)


def colocated_steps(model_dir: Path, ps: list[list[int]], chunk: int = 24) -> Steps:
    return colocated_spec_steps(model_dir, NEXTN, ps, GREEDY16, PS, chunk)


def run_and_check(pair: Pair, ps: list[list[int]], reference: Reference, model_dir: Path) -> list[Req]:
    return nextn.run_and_check(
        pair,
        ps,
        reference,
        model_dir,
        lambda lens: mtp_kv_bytes(model_dir, lens, PS),
        "PD, NEXTN on both sides vs colocated",
    )


@pytest.mark.parametrize("rounds", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_drafts_and_accepted_counts_as_colocated(deepseek: Path, ds_reference, rounds: int):
    """Layer-pipelined (3 target groups, the MTP layer its own last group), chunked prefill (24);
    a second round (the full sweep) finds the prompts in the prefill's prefix cache and their
    leading pages in the decode's (the MTP KV of that prefix came with its pages: only the rest
    moves). The fast suite runs one round of the two longer prompts."""
    ps = prompts(22, LENS) if rounds > 1 else prompts(22, LENS)[1:]
    want = colocated_steps(deepseek, ps)
    with make_pair(
        deepseek, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN, decode_radix_cache=True, layer_groups=3
    ) as pair:
        for round_ in range(rounds):
            decoded = run_and_check(pair, ps, ds_reference, deepseek)
            assert [d.spec.steps for d in decoded if d.spec is not None] == want, f"round {round_}"
            assert all(len(d.spec.steps[0][0]) == 3 for d in decoded if d.spec is not None)  # drafts at once
            assert (sum(d.cached_tokens for d in decoded) > 0) == (round_ == 1), [d.cached_tokens for d in decoded]
            assert (sum(d.timeline.prefix_hit_tokens for d in decoded) > 0) == (round_ == 1)  # the decode's
        assert pair.pipeline is not None and pair.pipeline.counters.batches_by_groups.get(3, 0) > 0


def test_an_mtp_layer_that_predicts_the_target_accepts_every_draft_from_the_first_step(bigram: Path, bigram_reference):
    ps = prompts(21, LENS)
    with make_pair(bigram, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN) as pair:
        decoded = run_and_check(pair, ps, bigram_reference, bigram)
    steps = [d.spec.steps for d in decoded if d.spec is not None]
    assert len(steps) == len(ps) and all(len(s[0][0]) == s[0][1] == 3 for s in steps)  # all 3 at once
    assert all(a == len(drafts) for s in steps for drafts, a in s)


@pytest.mark.parametrize("what", ["mtp_kv", pytest.param("hidden", marks=pytest.mark.slow)])
def test_negative_control_landed_mtp_state_zeroed(deepseek: Path, ds_reference, what: str):
    """What the per-step checks catch: the decode's landed MTP KV (or its hidden row, the aux)
    zeroed before its first step keeps the outputs (verification) but not the first step's
    drafts, which differ from the colocated engine's."""
    ps = prompts(24, [40])
    want = colocated_steps(deepseek, ps)

    def zero(pair: Pair, d: Req) -> None:
        mtp = pair.decode.mtp
        assert mtp is not None and d.draft_pages.size
        if what == "mtp_kv":
            mtp.pool.k[0][torch.as_tensor(d.draft_pages)] = 0
        else:
            mtp.seqs[d.rid].hidden.zero_()

    with make_pair(deepseek, 24, prefill_speculative=NEXTN, decode_speculative=NEXTN) as pair:
        reqs = [pair.reqs(ids, GREEDY16) for ids in ps]
        pair.run(reqs, timeout_s=120.0, on_landed=zero)
        decoded = [d for _, d in reqs]
        assert_pd_matches(decoded, ps, ds_reference, f"PD, {what} zeroed on arrival")
        first = [d.spec.steps[0] for d in decoded if d.spec is not None]
        assert len(first) == len(ps) and all(f != w[0] for f, w in zip(first, want)), (first, want)
        pair.settle()


def test_failures_and_aborts_free_every_page_and_mtp_state_on_both_sides(deepseek: Path, ds_reference):
    failures_then_decode_abort(
        deepseek, ds_reference, no_mtp_state_on_either_side, prefill_speculative=NEXTN, decode_speculative=NEXTN
    )


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_nextn_on_one_side_only_is_refused_on_both(deepseek: Path, side: str):
    """The prefill would send MTP KV and a hidden state nobody holds, or the decode wait for
    them: refused by the handshake's `speculative` field, on both sides, nothing left behind."""
    with make_pair(deepseek, bootstrap_timeout_s=30.0, **{f"{side}_speculative": NEXTN}) as pair:
        p, d = pair.reqs(prompts(25, [20])[0])
        p_out, d_out = pair.run([(p, d)], timeout_s=10.0)
        mine = "'nextn:mtp=layer"
        want = f"prefill {mine}" if side == "prefill" else f"prefill 'none', decode {mine}"
        for outs in (p_out, d_out):
            detail = str(outs[p.rid][-1].finish_detail)
            assert outs[p.rid][-1].finish_reason is FinishReason.ABORT and REFUSED in detail, detail
            assert f"speculative decoding: {want}" in detail, detail
        for eng in (pair.prefill, pair.decode):
            assert eng.stats()["disaggregation"]["handshakes_refused"] == {"speculative": 1}
        pair.settle()


@pytest.mark.slow  # ~90 s on a loaded 2-core host; test_an_mtp_layer_that_predicts_... is its in-process sibling
def test_nextn_pd_through_router(bigram: Path, bigram_reference, tmp_path: Path):
    """prefill and decode both with NEXTN on the bigram model (Mooncake over loopback,
    sglang-router): the router's answers are the colocated tokens and logprobs, every draft is
    accepted (from the first step: 17 drafts in 23 tokens after the prefill's, 3 + 1 a step), and
    the prefill wrote the target's KV plus the MTP layer's."""
    nextn_flags = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")
    check_through_router(bigram, tmp_path, nextn_flags, bigram_reference, mtp_kv_bytes(bigram, LENS, PS), "PD NEXTN")
