"""PD with EAGLE heads under tensor parallelism, the same and different on the two sides
(disagg/mtp_transfer.py, engine/spec/eagle_drafter.py): a prefill and a decode Engine in this process
with their TP children, every rank's KV over its own Mooncake backend on loopback. The head runs
whole on TP rank 0 of each side, so its K/V (all its KV heads, never head-sliced like the
target's) moves from prefill rank 0 into decode rank 0 as the last layer group of a
layer-pipelined, chunked prefill, with the target's last hidden state in rank 0's aux data. At
prefill TP x decode TP = (1,2) and (2,1) the drafts proposed and accepted at every step equal a
colocated EAGLE engine's for the same requests (what shows the head state arrived on the rank
that drafts), a head that predicts the target has every draft accepted from the first step, and
at (2,2) through sglang-router too; the bytes written are the target's K/V as the head-slice
mapping moves it plus the head's K/V once; both sides free every page and head state.
tests/unit/test_eagle_transfer_tp.py plans the same moves without processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.engine.request import Req
from tests.helpers import nextn
from tests.helpers.draft_models import bigram_copy, write_eagle_head
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.nextn import GREEDY16, LENS, check_tp2_through_router, eagle, head_kv_bytes
from tests.helpers.pd_pair import PS, Pair, Reference, colocated_greedy, make_pair, prompts
from tests.helpers.tolerance import Route

pytest.importorskip("mooncake.engine")

ROUTE = Route.ACROSS_PROCESSES  # TP children: other processes, other all-reduce orders
CHUNK, GROUPS = 24, 2
TPS = pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)], ids=["tp1-tp2", "tp2-tp1"])


@pytest.fixture(scope="module")
def bigram(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bigram_copy(tiny_model_dir, tmp_path_factory.mktemp("bigram") / "m")


@pytest.fixture(scope="module")
def heads(bigram: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """For the bigram target: the exact head, and a noisy one (chains accepted in part)."""
    tmp = tmp_path_factory.mktemp("heads")
    return {
        "exact": write_eagle_head(bigram, tmp / "exact", bigram=1.0, noise=0.0),
        "noisy": write_eagle_head(bigram, tmp / "noisy", bigram=1.0, noise=0.5, seed=2),
    }


@pytest.fixture(scope="module")
def reference(bigram: Path) -> Iterator[Reference]:
    yield from colocated_greedy(bigram)


def run_and_check(
    pair: Pair, ps: list[list[int]], reference: Reference, target: Path, head: Path, tp: tuple[int, int]
) -> list[Req]:
    """nextn.run_and_check through the TP pair, with the head's K and V (once) in the MTP layer's place."""
    return nextn.run_and_check(
        pair,
        ps,
        reference,
        target,
        lambda lens: head_kv_bytes(head, lens),
        f"PD EAGLE at TP {tp} vs colocated",
        tp=tp,
        route=ROUTE,
        timeout_s=180.0,
    )


def tp_pair(target: Path, head: Path, p_tp: int, d_tp: int):
    spec = eagle(head)
    return make_pair(
        target,
        CHUNK,
        prefill_speculative=spec,
        decode_speculative=spec,
        layer_groups=GROUPS,
        prefill_tp=p_tp,
        decode_tp=d_tp,
    )


# Two TP engines with their children and a colocated run (~90 s each beside a running `make test` on 2 cores):
# slow, like the NEXTN TP PD tests; the fast suite plans the same moves in
# tests/unit/test_eagle_transfer_tp.py and runs EAGLE PD at TP 1 in test_pd_eagle.py.
@pytest.mark.slow
@TPS
def test_drafts_and_accepted_counts_as_colocated(bigram: Path, heads, reference, p_tp: int, d_tp: int):
    """Layer-pipelined (2 target groups, the head rank 0's own last group), chunked prefill (24),
    the noisy head (chains accepted in part): every step's drafts and accepted count equal a
    colocated EAGLE engine's (TP 1), the first step drafts at once."""
    head = heads["noisy"]
    ps = prompts(22, LENS)
    want = colocated_spec_steps(bigram, eagle(head), ps, GREEDY16, PS, CHUNK)
    assert any(0 < a < len(d) for steps in want for d, a in steps)  # some chains accepted in part
    with tp_pair(bigram, head, p_tp, d_tp) as pair:
        decoded = run_and_check(pair, ps, reference, bigram, head, (p_tp, d_tp))
        assert pair.pipeline is not None and pair.pipeline.counters.batches_by_groups.get(GROUPS, 0) > 0
    assert [d.spec.steps for d in decoded if d.spec is not None] == want
    assert all(len(d.spec.steps[0][0]) == 3 for d in decoded if d.spec is not None)  # drafts at once


@pytest.mark.slow  # two TP engines with their children (~30 s+); TP 1's sibling: test_pd_eagle.py
@TPS
def test_a_head_that_predicts_the_target_accepts_every_draft_from_the_first_step(
    bigram: Path, heads, reference, p_tp: int, d_tp: int
):
    ps = prompts(21, LENS)
    head = heads["exact"]
    with tp_pair(bigram, head, p_tp, d_tp) as pair:
        decoded = run_and_check(pair, ps, reference, bigram, head, (p_tp, d_tp))
    steps = [d.spec.steps for d in decoded if d.spec is not None]
    assert len(steps) == len(ps) and all(len(s[0][0]) == s[0][1] == 3 for s in steps)  # all 3 at once
    assert all(a == len(drafts) for s in steps for drafts, a in s)


@pytest.mark.slow  # two TP 2 servers with their children and sglang-router (~60 s+ on 2 loaded cores)
def test_a_head_that_predicts_the_target_accepts_every_draft_from_the_first_step_tp2_tp2(
    bigram: Path, heads, reference, tmp_path: Path
):
    """Through sglang-router (one TP engine per process: two servers, not an in-process pair):
    greedy tokens and logprobs as colocated, every draft accepted from the first step (5 steps of
    3 drafts and one of 2 after the prefill's token: 23 tokens), which a head KV or hidden state
    missing on decode rank 0 would break at the first step; the bytes are the target's K/V as
    TP (2,2) moves it plus the head's K/V once; every room succeeded, no TP worker survives."""
    flags = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3")
    flags += ("--speculative-draft-model-path", str(heads["exact"]))
    chunks = ("--chunked-prefill-size", str(CHUNK), "--disaggregation-layer-groups", str(GROUPS))
    head_kv = head_kv_bytes(heads["exact"], LENS)
    check_tp2_through_router(bigram, tmp_path, (*chunks, *flags), reference, head_kv, "PD EAGLE at TP (2,2)")
