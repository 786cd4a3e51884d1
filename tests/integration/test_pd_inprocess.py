"""A prefill Engine and a decode Engine (their PD connectors) in one process over the `local`
backend (real bootstrap server, real ZMQ control plane; tests/helpers/pd_pair.py): greedy
exactness (tokens and logprobs) against the colocated Engine, a negative control (one transferred
page corrupted on the decode makes that check fail), and the request lifecycle, stepping both
engines from the test thread. Every wait is bounded."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from kvpipe.config import FaultInjection
from kvpipe.engine.request import FinishReason, Req, TokenOutput
from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.pd_pair import (
    GREEDY,
    PS,
    Pair,
    assert_landed_equals_cold,
    assert_pd_matches,
    colocated_greedy,
    greedy_and_bytes_as_predicted,
    make_pair,
    prompts,
    tokens,
)
from tests.helpers.pd_parity import KV_ITEMSIZE, expected_bytes

LENS = [1, 2, 15, 16, 17, 40, 100, 333]


@pytest.mark.parametrize("chunk", [0, 24])  # 24 does not divide into pages of 16
def test_greedy_matches_colocated(tiny_model_dir, reference, chunk):
    ps = prompts(chunk, LENS)
    with make_pair(tiny_model_dir, chunk) as pair:
        reqs = [pair.reqs(ids) for ids in ps]
        p_out, d_out = pair.run(reqs)
        assert_pd_matches([d for _, d in reqs], ps, reference)
        for p, d in reqs:
            assert tokens(d_out[d.rid]) == d.output_ids  # streamed token by token, first one included
            assert d_out[d.rid][0].token_ids == (d.output_ids[0],) and d.finish_reason is FinishReason.LENGTH
            final = p_out[p.rid][-1]  # the prefill answers with its first token once the KV landed
            assert final.finish_reason is FinishReason.LENGTH and final.token_ids == (d.output_ids[0],)
        st = pair.prefill.stats()["disaggregation"]
        assert st["rooms_succeeded"] == len(ps) and st["rooms_failed"] == 0 and st["bytes_written"] > 0
        pair.settle()


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_kv_cache_dtype_matches_colocated_and_shrinks_the_bytes(tiny_model_dir, kv):
    """--kv-cache-dtype on both sides, two layer groups: tokens and logprobs equal the colocated
    engine's with the same KV dtype, and the bytes written are the prediction for the dtype's
    element size: exactly 1/2 (bf16) or 1/4 (fp8) of what fp32 KV moves for the same prompts."""
    ref = colocated_greedy(tiny_model_dir, kv)
    try:
        greedy_and_bytes_as_predicted(tiny_model_dir, next(ref), 0, 2, LENS, kv_cache_dtype=kv)
    finally:
        ref.close()
    ps = [len(p) for p in prompts(2, LENS)]
    fp32, ours = (expected_bytes(tiny_model_dir, ps, PS, 1, 1, kv_itemsize=KV_ITEMSIZE[x]) for x in ("auto", kv))
    assert ours * 4 == fp32 * KV_ITEMSIZE[kv]


def test_bf16_model_matches_colocated_bf16(tiny_model_dir):
    """--dtype bfloat16 on both sides (bf16 weights, activations and KV; bf16_panel.cpp's linears)
    with two layer groups: tokens and logprobs equal the colocated bf16 engine's (the same kernels
    in one process: the same bits whatever rows share a step), and half the fp32 KV bytes move.
    Whole prompts (chunk 0), as with a low-precision KV dtype (pd_parity.colocated_reference): a
    later chunk's attention reads the earlier chunks' KV through the paged path, whose sums round
    to bf16 elsewhere than the whole prompt's (a logprob moved by one bf16 step, 0.016)."""
    ref = colocated_greedy(tiny_model_dir, dtype="bfloat16")
    ps = prompts(5, LENS)
    try:
        reference = next(ref)
        with make_pair(tiny_model_dir, 0, layer_groups=2, dtype="bfloat16") as pair:
            assert next(pair.decode.runner.model.parameters()).dtype == torch.bfloat16
            reqs = [pair.reqs(ids) for ids in ps]
            pair.run(reqs)
            assert_pd_matches([d for _, d in reqs], ps, reference, "PD vs colocated, bf16")
            st = pair.prefill.stats()["disaggregation"]
            assert (st["rooms_succeeded"], st["rooms_failed"]) == (len(ps), 0)
            want = expected_bytes(tiny_model_dir, [len(p) for p in ps], PS, 1, 1, kv_itemsize=2)
            assert st["bytes_written"] == want
            pair.settle()
    finally:
        ref.close()


@pytest.mark.parametrize(
    "target,hit",
    [
        (7, KVCorruption(layer=3, page=-1)),  # the 333-token prompt's last page, last layer
        (5, KVCorruption(layer=0, page=1, head=1)),  # one KV head of the 40-token prompt's second page
    ],
    ids=["last_page", "head_slice"],
)
def test_a_corrupted_destination_page_fails_the_check(tiny_model_dir, reference, target, hit):
    """Negative control: the chunk-24 case with one page (or one head slice of it) of one layer
    overwritten in the decode's pool after it landed and before the decode read it: the exactness
    check fails on that prompt alone, at a decoded position (the first token is the prefill's)."""
    ps = prompts(24, LENS)

    def corrupt(pair: Pair, d: Req) -> None:
        if d.input_ids == ps[target]:
            hit.apply(pair.decode.runner.pool, d.pages)

    with make_pair(tiny_model_dir, 24) as pair:
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs, on_landed=corrupt)
        pattern = rf"same process and TP: prompt {target} \({len(ps[target])} tokens\): [^\n]*position [1-9][^\n]*\Z"
        with pytest.raises(AssertionError, match=pattern):
            assert_pd_matches([d for _, d in reqs], ps, reference)
        pair.settle()


def test_destination_pages_equal_a_cold_colocated_run(tiny_model_dir):
    """What lands in the decode's pages (chunked prefill of 24, before any decode step) is the KV a
    cold colocated engine holds for the same prompt after its whole prefill: every layer, K and V,
    every position."""
    assert_landed_equals_cold(tiny_model_dir, prompts(24, [17, 40, 100]), chunk=24)


def test_first_token_finishes(tiny_model_dir, reference):
    """max_new_tokens=1 and EOS / stop id on the first token finish on the decode without a decode step."""
    ids = prompts(7, [50])[0]
    first = reference(ids).tokens[0]
    with make_pair(tiny_model_dir) as pair:
        one = pair.reqs(ids, replace(GREEDY, max_new_tokens=1))
        eos = pair.reqs(ids, replace(GREEDY, ignore_eos=False))
        eos[1].eos_token_ids = (first,)
        stop = pair.reqs(ids, replace(GREEDY, stop_token_ids=(first,)))
        _, d_out = pair.run([one, eos, stop])
        assert one[1].output_ids == [first] and one[1].finish_reason is FinishReason.LENGTH
        for _, d in (eos, stop):
            assert d.output_ids == [first] and d.finish_reason is FinishReason.STOP and d.finish_detail == first
            assert [o.token_ids for o in d_out[d.rid]] == [(first,)]
        assert pair.decode.stats()["num_running"] == 0
        pair.settle()


def test_rejections(tiny_model_dir):
    """Missing bootstrap info and rooms in use are refused; a prompt the prefill cannot hold
    fails on the decode at once, not after a timeout."""
    with make_pair(tiny_model_dir, p_pages=4) as pair:
        with pytest.raises(ValueError, match="bootstrap_room"):
            pair.prefill.add_request(Req("x", [5, 6], GREEDY))
        with pytest.raises(ValueError, match="bootstrap_host"):
            pair.decode.add_request(Req("x", [5, 6], GREEDY, bootstrap_room=1))
        p, d = pair.reqs([7] * 20, room=77)
        pair.prefill.add_request(p)
        with pytest.raises(ValueError, match="already in use"):
            pair.prefill.add_request(pair.reqs([7] * 20, room=77, rid="other")[0])
        pair.decode.add_request(d)
        with pytest.raises(ValueError, match="already in use"):
            pair.decode.add_request(pair.reqs([7] * 20, room=77, rid="other")[1])
        big_p, big_d = pair.reqs([9] * 100)  # 7 pages; the prefill pool has 4
        t0 = time.monotonic()
        p_out, _ = pair.run([(big_p, big_d)])
        assert time.monotonic() - t0 < 10.0  # well before the 20 s bootstrap and 30 s waiting timeouts
        assert p_out[big_p.rid][-1].finish_reason is FinishReason.ABORT
        assert big_d.finish_reason is FinishReason.ABORT and "prefill" in str(big_d.finish_detail)
        pair.run([], until=lambda: d.finished)
        assert d.output_ids and d.finish_reason is FinishReason.LENGTH
        pair.settle()


def test_injected_failures_and_aborts_free_pages(tiny_model_dir, reference):
    # Each transfer batch fails with p 0.3, and how many batches a room takes (its chunks, how
    # they coalesce) depends on timing: short prompts (1-2 batches) among long ones (5-7), and at
    # most 6 failed batches for the 12 rooms, so both outcomes come whatever the timing (all 6
    # rooms of an earlier, shorter list failed once on a loaded machine)
    with make_pair(tiny_model_dir, chunk=32, inject=FaultInjection(prob=0.3, seed=3, max_failures=6)) as pair:
        ps = prompts(11, [20, 64, 90, 130, 200, 47, 12, 25, 9, 30, 17, 160])
        reqs = [pair.reqs(ids) for ids in ps]
        _, d_out = pair.run(reqs)
        failed = [d for _, d in reqs if d.finish_reason is FinishReason.ABORT]
        ok = [(d, ids) for (_, d), ids in zip(reqs, ps) if d.finish_reason is not FinishReason.ABORT]
        assert failed and ok, "the seed should give both outcomes"
        for d in failed:
            assert "KV transfer failed" in str(d.finish_detail)
        assert_pd_matches([d for d, _ in ok], [ids for _, ids in ok], reference, "rooms that succeeded")
        pair.settle()
    with make_pair(tiny_model_dir, chunk=32) as pair:
        # Decode-side abort while the prefill still computes; prefill-side abort after its prefill.
        a = pair.reqs(prompts(1, [300])[0])
        b = pair.reqs(prompts(2, [40])[0])
        pair.prefill.add_request(a[0])
        pair.decode.add_request(a[1])
        pair.prefill.step()  # the first of ten chunks
        end = time.monotonic() + 30
        while pair.receiver.room_state(a[1].bootstrap_room) is not TransferState.WAITING_FOR_INPUT:
            assert time.monotonic() < end, "the decode never asked the prefill for the KV"
            pair.decode.step()
        pair.decode.abort(a[1].rid)
        t0 = time.monotonic()
        pair.run([b], until=lambda: a[0].finished and a[1].finished and b[1].finished)
        assert a[1].finish_reason is FinishReason.ABORT and b[1].finish_reason is FinishReason.LENGTH
        assert a[0].finish_reason is FinishReason.ABORT and a[0].num_cached < 300  # the prefill stopped early
        pair.settle()
        assert time.monotonic() - t0 < 15  # the abort reached the prefill; no timeout was involved
        c = pair.reqs(prompts(3, [40])[0])
        pair.decode.add_request(c[1])  # the prefill request comes later, is aborted when done
        pair.prefill.add_request(c[0])
        p_out, d_out = pair.run([], until=lambda: c[0].finished)
        pair.prefill.abort(c[0].rid)
        pair.run([], until=lambda: c[1].finished)
        assert c[1].finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)  # it may have landed already
        pair.settle()


def test_prefill_forward_error_reaches_decode(tiny_model_dir):
    with make_pair(tiny_model_dir) as pair:
        p, d = pair.reqs(prompts(5, [60])[0])
        pair.prefill.add_request(p)
        pair.decode.add_request(d)
        real_run = pair.prefill.runner.run

        def broken(*a, **kw):
            pair.prefill.runner.run = real_run  # fail once
            raise RuntimeError("device lost")

        pair.prefill.runner.run = broken
        with pytest.raises(RuntimeError, match="device lost"):
            for _ in range(1000):  # bounded: the first prefill forward raises
                pair.prefill.step()
        _, d_out = pair.run([], until=lambda: d.finished)
        assert d.finish_reason is FinishReason.ABORT and "forward failed: device lost" in str(d.finish_detail)
        pair.settle()
        ok = pair.reqs(prompts(6, [30])[0])  # both keep serving
        pair.run([ok])
        assert ok[1].finish_reason is FinishReason.LENGTH


def test_prefill_abort_before_its_forward_after_the_decode_asked(tiny_model_dir):
    """The decode's TransferRequest reached the prefill first; the prefill request is aborted
    while queued: the room fails on both sides and no room stays active (a regression: the sender
    buried a room it knew only from the decode, and the prefill waited for it forever)."""
    with make_pair(tiny_model_dir) as pair:
        p, d = pair.reqs(prompts(4, [30])[0])
        pair.decode.add_request(d)
        end = time.monotonic() + 30
        while pair.sender.room_state(p.bootstrap_room) is None:
            assert time.monotonic() < end, "the decode's request never reached the prefill"
            pair.decode.step()
        pair.prefill.add_request(p)
        pair.prefill.abort(p.rid)
        pair.run([], until=lambda: p.finished and d.finished)
        assert p.finish_reason is FinishReason.ABORT and d.finish_reason is FinishReason.ABORT
        pair.settle()
        assert pair.prefill.stats()["disaggregation"]["active_rooms"] == 0


def test_first_token_leaves_before_the_next_decode_forward(tiny_model_dir, reference):
    """The decode step that learns of the KV returns the prefill's first token at once (no decode
    forward in between), and the receiver wakes the engine's loop when the transfer news arrives."""
    ids = prompts(11, [70])[0]
    with make_pair(tiny_model_dir) as pair:
        woke = threading.Event()
        pair.decode.set_wakeup(woke.set)
        p, d = pair.reqs(ids)
        pair.prefill.add_request(p)
        pair.decode.add_request(d)
        end = time.monotonic() + 60
        first: list[TokenOutput] = []
        while not first:
            assert time.monotonic() < end, "no first token within 60 s"
            pair.prefill.step()
            first = [o for o in pair.decode.step() if o.rid == d.rid]
        assert woke.is_set()
        want = reference(ids)
        assert first[0].token_ids == want.tokens[:1]
        assert d.output_ids == list(want.tokens[:1])  # the decode has not run a forward for it yet
        while not d.finished:
            assert time.monotonic() < end, "decode did not finish within 60 s"
            pair.prefill.step()
            pair.decode.step()
        assert_pd_matches([d], [ids], reference)
        pair.settle()


def test_a_decode_abort_before_the_request_frees_the_prefill_at_once(tiny_model_dir):
    """A request still waiting for decode pages when it is aborted never asked for its KV: the
    decode tells the prefill, which frees the computed KV now instead of at its bootstrap timeout."""
    with make_pair(tiny_model_dir, d_pages=12) as pair:
        a = pair.reqs(prompts(3, [100])[0], replace(GREEDY, max_new_tokens=60))  # 10 of the 12 decode pages
        b = pair.reqs(prompts(4, [40])[0])  # 3 pages: waits for a
        pair.run([a], until=lambda: len(a[1].output_ids) > 1)
        pair.run([b], until=lambda: b[0].prefill_done and len(a[1].output_ids) > 4)
        assert not b[1].finished and pair.receiver.room_state(b[1].bootstrap_room) is None  # never asked
        assert pair.decode.stats()["num_waiting"] == 1, pair.decode.stats()
        pair.decode.abort(b[1].rid)
        outs: list[TokenOutput] = []
        end = time.monotonic() + 30  # (without the decode's word it times out at 20 s, with another reason)
        while not any(o.rid == b[0].rid for o in outs):
            assert time.monotonic() < end, "the prefill kept the request the decode gave up on"
            outs += pair.prefill.step()
            pair.decode.step()
        [final] = [o for o in outs if o.rid == b[0].rid]
        assert b[1].finish_reason is FinishReason.ABORT and final.finish_reason is FinishReason.ABORT
        assert "aborted by decode before its request" in str(final.finish_detail), final
        assert pair.prefill.stats()["disaggregation"]["active_rooms"] == 0
        pair.decode.abort(a[1].rid)
        pair.settle()
