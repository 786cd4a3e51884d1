"""PD with EAGLE heads on both sides (the tiny Llama preset; in process, local backend; the NEXTN
path of disagg/mtp_transfer.py with the head in the MTP layer's place): the prefill runs the head
over the prompt chunk by chunk and sends its one-layer K/V after the target's layers (the last
layer group) and the target's last hidden state in the aux data, so the decode's head state holds
the prompt when the KV lands and its first step drafts at once. Greedy outputs equal the
colocated engine's; the drafts proposed and accepted at every step equal a colocated EAGLE
engine's for the same request (also behind the decode's cached prefixes), and a negative control
(the landed head K/V or hidden row zeroed) changes the first step's drafts; a head that predicts
the target has every draft accepted from the first step; the bytes written are the target's KV
plus the head's; servers whose heads differ refuse each other at bootstrap, on both sides."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpipe.engine.request import FinishReason, Req
from kvpipe.transfer.control.handshake import REFUSED
from tests.helpers import nextn
from tests.helpers.draft_models import bigram_copy, write_eagle_head
from tests.helpers.engine import colocated_spec_steps
from tests.helpers.nextn import GREEDY16, LENS, check_through_router, eagle, head_kv_bytes
from tests.helpers.pd_pair import PS, Pair, Reference, colocated_greedy, make_pair, prompts


@pytest.fixture(scope="module")
def bigram(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bigram_copy(tiny_model_dir, tmp_path_factory.mktemp("bigram") / "m")


@pytest.fixture(scope="module")
def heads(tiny_model_dir: Path, bigram: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """For the bigram target: the exact head, and two noisy ones (chains accepted in part); a
    random one for the tiny target."""
    tmp = tmp_path_factory.mktemp("heads")
    return {
        "random": write_eagle_head(tiny_model_dir, tmp / "random", seed=5),
        "exact": write_eagle_head(bigram, tmp / "exact", bigram=1.0, noise=0.0),
        "noisy": write_eagle_head(bigram, tmp / "noisy", bigram=1.0, noise=0.5, seed=2),
        "other": write_eagle_head(bigram, tmp / "other", bigram=1.0, noise=0.5, seed=3),
    }


@pytest.fixture(scope="module")
def reference(bigram: Path) -> Iterator[Reference]:
    yield from colocated_greedy(bigram)


def run_and_check(pair: Pair, ps: list[list[int]], reference: Reference, target: Path, head: Path) -> list[Req]:
    """nextn.run_and_check with the head's K and V in the MTP layer's place."""
    return nextn.run_and_check(
        pair, ps, reference, target, lambda lens: head_kv_bytes(head, lens), "PD, EAGLE on both sides vs colocated"
    )


def test_drafts_and_accepted_counts_as_colocated(bigram: Path, heads, reference):
    """Layer-pipelined (2 target groups, the head its own last group), chunked prefill (24), the
    noisy head (chains accepted in part); the second round finds the prompts in the prefill's
    cache and their leading pages in the decode's (the head KV of that prefix came with its
    pages: only the rest moves)."""
    head = heads["noisy"]
    ps = prompts(22, LENS)
    want = colocated_spec_steps(bigram, eagle(head), ps, GREEDY16, PS, 24)
    assert any(0 < a < len(d) for steps in want for d, a in steps)  # some chains accepted in part
    spec = eagle(head)
    with make_pair(
        bigram, 24, prefill_speculative=spec, decode_speculative=spec, decode_radix_cache=True, layer_groups=2
    ) as pair:
        for round_ in range(2):
            decoded = run_and_check(pair, ps, reference, bigram, head)
            assert [d.spec.steps for d in decoded if d.spec is not None] == want, f"round {round_}"
            assert all(len(d.spec.steps[0][0]) == 3 for d in decoded if d.spec is not None)  # drafts at once
            assert (sum(d.timeline.prefix_hit_tokens for d in decoded) > 0) == (round_ == 1)
        assert pair.pipeline is not None and pair.pipeline.counters.batches_by_groups.get(2, 0) > 0


@pytest.mark.parametrize("what", ["nothing", "head_kv", "hidden"])
def test_negative_control_landed_head_state_zeroed(tiny_model_dir: Path, heads, what: str):
    """What the per-step checks catch: on the tiny target with a random head, every step's drafts
    are the colocated engine's (the control), but with the decode's landed head K/V (or its
    hidden row, the aux) zeroed before its first step the first step's drafts differ (the
    outputs stay the target's: verification)."""
    head = heads["random"]
    ps = prompts(24, [40, 33])
    want = colocated_spec_steps(tiny_model_dir, eagle(head), ps, GREEDY16, PS, 24)

    def zero(pair: Pair, d: Req) -> None:
        mtp = pair.decode.mtp
        assert mtp is not None and d.draft_pages.size
        if what == "nothing":  # the control: every step's drafts as colocated
            return
        if what == "head_kv":
            pages = torch.as_tensor(d.draft_pages)
            mtp.pool.k[0][pages] = 0
            mtp.pool.v[0][pages] = 0
        else:
            mtp.seqs[d.rid].hidden.zero_()

    spec = eagle(head)
    with make_pair(tiny_model_dir, 24, prefill_speculative=spec, decode_speculative=spec) as pair:
        reqs = [pair.reqs(ids, GREEDY16) for ids in ps]
        pair.run(reqs, timeout_s=120.0, on_landed=zero)
        decoded = [d for _, d in reqs]
        assert all(d.finish_reason is FinishReason.LENGTH for d in decoded)
        if what == "nothing":
            assert [d.spec.steps for d in decoded if d.spec is not None] == want
        else:
            first = [d.spec.steps[0] for d in decoded if d.spec is not None]
            assert len(first) == len(ps) and all(f != w[0] for f, w in zip(first, want)), (first, want)
        pair.settle()


def test_a_head_that_predicts_the_target_accepts_every_draft_from_the_first_step(bigram: Path, heads, reference):
    ps = prompts(21, LENS)
    spec = eagle(heads["exact"])
    with make_pair(bigram, 24, prefill_speculative=spec, decode_speculative=spec) as pair:
        decoded = run_and_check(pair, ps, reference, bigram, heads["exact"])
    steps = [d.spec.steps for d in decoded if d.spec is not None]
    assert len(steps) == len(ps) and all(len(s[0][0]) == s[0][1] == 3 for s in steps)  # all 3 at once
    assert all(a == len(drafts) for s in steps for drafts, a in s)


def test_servers_whose_heads_differ_refuse_each_other(bigram: Path, heads):
    """Another head on the decode (same dims and layout, other weights): the handshake names the
    head's digest, so both sides refuse; nothing is left behind."""
    with make_pair(
        bigram,
        bootstrap_timeout_s=30.0,
        prefill_speculative=eagle(heads["noisy"]),
        decode_speculative=eagle(heads["other"]),
    ) as pair:
        p, d = pair.reqs(prompts(25, [20])[0])
        p_out, d_out = pair.run([(p, d)], timeout_s=10.0)
        for outs in (p_out, d_out):
            detail = str(outs[p.rid][-1].finish_detail)
            assert outs[p.rid][-1].finish_reason is FinishReason.ABORT and REFUSED in detail, detail
            assert "speculative decoding: prefill 'eagle:head=" in detail and "decode 'eagle:head=" in detail, detail
        for eng in (pair.prefill, pair.decode):
            assert eng.stats()["disaggregation"]["handshakes_refused"] == {"speculative": 1}
        pair.settle()


@pytest.mark.slow  # ~90 s on a loaded 2-core host; test_a_head_that_predicts_... is its in-process sibling
def test_eagle_pd_through_router(bigram: Path, heads, reference, tmp_path: Path):
    """prefill and decode servers both with the exact EAGLE head on the bigram target (`kvpipe
    serve` flags, Mooncake over loopback, sglang-router): the router's answers are the colocated
    tokens and logprobs, every draft is accepted from the first step (17 drafts in 23 tokens
    after the prefill's, 3 + 1 a step), and the prefill wrote the target's KV plus the head's."""
    flags = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3")
    flags += ("--speculative-draft-model-path", str(heads["exact"]))
    check_through_router(bigram, tmp_path, flags, reference, head_kv_bytes(heads["exact"], LENS), "PD EAGLE")
