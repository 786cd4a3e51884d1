"""NEXTN in PD with tensor parallelism, the same and different on the two sides
(disagg/mtp_transfer.py): a prefill and a decode Engine in this process with their TP children,
every rank's KV over its own Mooncake backend on loopback. The MTP layer runs whole on TP rank 0
of each side and prefill rank 0 writes its latent KV into decode rank 0 (the last layer group of
a layer-pipelined, chunked prefill), with the target's last hidden state in rank 0's aux data. At
prefill TP x decode TP = (1,2) and (2,1) the drafts proposed and accepted at every step equal a
colocated NEXTN engine's for the same requests (what shows the MTP state arrived on the rank that
drafts); an MTP layer that predicts the target has every draft accepted from the first step at
(2,2) (two servers through sglang-router: one TP engine per process); the bytes written are the
target's KV as the head-slice mapping moves it (the latent whole to every decode rank) plus the
MTP KV once; injected write failures and a decode abort leave no page and no MTP state on either
side. tests/unit/test_mtp_transfer_tp.py plans the same moves without processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.draft_models import bigram_copy
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.nextn import (
    GREEDY16,
    LENS,
    NEXTN,
    check_tp2_through_router,
    mtp_kv_bytes,
    no_mtp_state_on_either_side,
    run_and_check,
)
from tests.helpers.pd_pair import (
    PS,
    Reference,
    colocated_greedy,
    failures_then_decode_abort,
    make_pair,
    prompts,
)
from tests.helpers.tolerance import Route

pytest.importorskip("mooncake.engine")

ROUTE = Route.ACROSS_PROCESSES  # TP children: other processes, other all-reduce orders
CHUNK, GROUPS = 24, 3


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


# Two TP engines with their children and a colocated run (~30 s each on 2 loaded cores, about as
# much for one prompt: start-up): slow, like the STANDALONE TP PD tests; the fast suite plans the
# same moves in tests/unit/test_mtp_transfer_tp.py. Negative control (run by hand): a decode that
# asks no rank for the MTP pages fails here (the bytes written lack the MTP KV).
@pytest.mark.slow
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)], ids=["tp1-tp2", "tp2-tp1"])
def test_drafts_and_accepted_counts_as_colocated(deepseek: Path, ds_reference, p_tp: int, d_tp: int):
    """Layer-pipelined (3 target groups, the MTP layer rank 0's own last group), chunked prefill
    (24): every step's drafts and accepted count equal a colocated NEXTN engine's (TP 1), the
    first step drafts at once."""
    ps = prompts(22, LENS)[1:]
    want = colocated_spec_steps(deepseek, NEXTN, ps, GREEDY16, PS, CHUNK)
    with make_pair(
        deepseek,
        CHUNK,
        prefill_speculative=NEXTN,
        decode_speculative=NEXTN,
        layer_groups=GROUPS,
        prefill_tp=p_tp,
        decode_tp=d_tp,
    ) as pair:
        tp = (p_tp, d_tp)
        decoded = run_and_check(
            pair,
            ps,
            ds_reference,
            deepseek,
            lambda lens: mtp_kv_bytes(deepseek, lens, PS),
            f"PD NEXTN at TP {tp} vs colocated",
            tp=tp,
            route=ROUTE,
            timeout_s=180.0,
        )
        assert not any(d.timeline.prefix_hit_tokens for d in decoded)  # no radix cache: the whole prompts moved
        assert pair.pipeline is not None and pair.pipeline.counters.batches_by_groups.get(GROUPS, 0) > 0
    assert [d.spec.steps for d in decoded if d.spec is not None] == want
    assert all(len(d.spec.steps[0][0]) == 3 for d in decoded if d.spec is not None)  # drafts at once


@pytest.mark.slow  # two TP 2 servers with their children and sglang-router (~60 s on 2 loaded cores)
def test_an_mtp_layer_that_predicts_the_target_accepts_every_draft_from_the_first_step_tp2_tp2(
    bigram: Path, bigram_reference, tmp_path: Path
):
    """Through sglang-router (one TP engine per process: two servers, not an in-process pair):
    greedy tokens and logprobs as colocated, every draft accepted from the first step (5 steps of
    3 drafts and one of 2 after the prefill's token: 23 tokens), which an MTP KV or hidden state
    missing on decode rank 0 would break at the first step; the bytes are the target's latent
    once per decode rank plus the MTP KV once; every room succeeded, no TP worker survives."""
    nextn = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")
    chunks = ("--chunked-prefill-size", str(CHUNK), "--disaggregation-layer-groups", "2")
    mtp_kv = mtp_kv_bytes(bigram, LENS, PS)
    check_tp2_through_router(bigram, tmp_path, (*chunks, *nextn), bigram_reference, mtp_kv, "PD NEXTN at TP (2,2)")


@pytest.mark.slow  # a TP 2 server with its child, six prompts (~30 s); TP 1's sibling: test_pd_nextn.py
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["tp2-tp1", "tp1-tp2"])
def test_failures_and_aborts_free_every_page_and_mtp_state_on_both_sides(
    deepseek: Path, ds_reference, p_tp: int, d_tp: int
):
    failures_then_decode_abort(
        deepseek,
        ds_reference,
        no_mtp_state_on_either_side,
        route=ROUTE,
        prefill_speculative=NEXTN,
        decode_speculative=NEXTN,
        prefill_tp=p_tp,
        decode_tp=d_tp,
    )
