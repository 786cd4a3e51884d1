"""Helpers of the PD tests of the MTP-style drafters (NEXTN on DeepSeek-V3 and Qwen3.5, EAGLE):
what the MTP layer's KV weighs on the wire, the decode's MTP state when a request's KV landed,
the check that no MTP state is left, a pair's run checked end to end, and the same through two
servers and sglang-router."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.draft.eagle import eagle_config
from tests.helpers.pd_pair import PS, Pair, Reference, assert_pd_matches, prompts
from tests.helpers.pd_parity import expected_bytes, state_slot_nbytes
from tests.helpers.pd_stack import (
    close_and_check_no_orphans,
    disagg_stats,
    generate,
    greedy,
    start_stack,
    start_tp_stack,
)
from tests.helpers.tolerance import Generation, Route, assert_same_generations

GREEDY16 = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
LENS = [17, 40, 70]  # inside a page, across pages, across chunks of 24
NEXTN = SpeculativeConfig("NEXTN", num_steps=3)


def eagle(head: Path) -> SpeculativeConfig:
    return SpeculativeConfig("EAGLE", num_steps=3, draft_model_path=str(head))


def head_kv_bytes(head: Path, lens: list[int]) -> int:
    """An EAGLE head's K and V of the prompts: whole pages, one layer, its KV heads, fp32."""
    cfg = eagle_config(head)
    return sum(-(-n // PS) for n in lens) * PS * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def mtp_kv_bytes(model_dir: Path, lens: list[int], page_size: int, itemsize: int = 4) -> int:
    """The MTP layer's KV of prompts of `lens` tokens: whole pages, one layer, in the model's
    dtype (`itemsize`): DeepSeek-V3's latent, or Qwen3.5's full-attention K and V of every KV head."""
    mc = model_config_of(model_dir)
    per_token = mc.mla.latent_dim if mc.mla is not None else 2 * mc.num_kv_heads * mc.head_dim
    return sum(-(-n // page_size) for n in lens) * page_size * per_token * itemsize


def mtp_state_at_landing(landed: dict[str, tuple[int, int, int]]) -> Callable[[Pair, Req], None]:
    """Pair.run's on_landed: (valid MTP KV positions, hidden rows, hidden size) the decode's MTP
    state holds for the request when its KV landed, before any decode step."""

    def keep(pair: Pair, d: Req) -> None:
        mtp = pair.decode.mtp
        assert mtp is not None
        seq = mtp.seqs.get(d.rid)
        landed[d.rid] = (-1, 0, 0) if seq is None else (seq.valid, *seq.hidden.shape)

    return keep


def assert_no_mtp_state(engine: Engine) -> None:
    mtp = engine.mtp
    assert mtp is not None and not mtp.seqs, None if mtp is None else list(mtp.seqs)
    assert len(mtp.free_private) == mtp.num_private  # every copy-on-write page is back


def no_mtp_state_on_either_side(pair: Pair) -> None:
    assert_no_mtp_state(pair.prefill)
    assert_no_mtp_state(pair.decode)


def run_and_check(
    pair: Pair,
    ps: list[list[int]],
    reference: Reference,
    target: Path,
    draft_kv_bytes: Callable[[list[int]], int],
    what: str,
    check_free: Callable[[Pair], None] = no_mtp_state_on_either_side,
    tp: tuple[int, int] = (1, 1),
    route: Route = Route.SAME_PROCESS,
    timeout_s: float = 120.0,
) -> list[Req]:
    """Every prompt through the pair (drafting on both sides), GREEDY16: outputs as colocated;
    the decode's MTP state (rank 0's) when the KV landed holds rows [0, L - 1) and one hidden
    row (h_{L-1}, the aux); the bytes written are the target's KV past the prefix the decode's
    radix cache held as TP `tp` moves it, each request's whole recurrent state (a hybrid
    target's), and the drafter's KV (`draft_kv_bytes` of the prompt lengths) past that prefix;
    both sides free (`check_free`)."""
    landed: dict[str, tuple[int, int, int]] = {}
    before = pair.prefill.stats()["disaggregation"]["bytes_written"]
    reqs = [pair.reqs(ids, GREEDY16) for ids in ps]
    pair.run([(p, d) for p, d in reqs], timeout_s=timeout_s, on_landed=mtp_state_at_landing(landed))  # Req | None pairs
    decoded = [d for _, d in reqs]
    assert all(d.finish_reason is FinishReason.LENGTH for d in decoded), [d.finish_detail for d in decoded]
    assert_pd_matches(decoded, ps, reference, what, route)
    mc = model_config_of(target)
    assert [landed[d.rid] for d in decoded] == [(len(p) - 1, 1, mc.hidden_size) for p in ps]  # nothing recomputed
    lens, held = [len(p) for p in ps], [d.timeline.prefix_hit_tokens for d in decoded]  # whole pages
    held_kv = expected_bytes(target, held, PS, *tp) - len(held) * state_slot_nbytes(mc)  # the state moves whole
    target_bytes = expected_bytes(target, lens, PS, *tp) - held_kv
    draft_kv = draft_kv_bytes(lens) - draft_kv_bytes(held)
    assert pair.prefill.stats()["disaggregation"]["bytes_written"] - before == target_bytes + draft_kv
    pair.settle()
    check_free(pair)
    return decoded


def _greedy_through_router(router: str, ps: list[list[int]], reference: Reference, what: str) -> list[dict]:
    """24 greedy tokens per prompt through `router`, checked against the colocated `reference`
    (tokens and logprobs); returns each answer's meta_info (the speculation counts)."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = [generate(router, {"input_ids": p, "sampling_params": greedy(24), "return_logprob": True}) for p in ps]
    want = [reference(p, params) for p in ps]
    assert_same_generations([Generation.of(o) for o in outs], want, Route.ACROSS_PROCESSES, ps, what)
    return [o["meta_info"] for o in outs]


def check_through_router(
    target: Path, tmp_path: Path, spec_flags: tuple[str, ...], reference: Reference, draft_kv_bytes: int, what: str
) -> None:
    """Prefill and decode servers both drafting with `spec_flags` (3 steps) on a target whose
    drafter predicts it (Mooncake over loopback, sglang-router), chunked prefill (24): the
    router's answers are the colocated tokens and logprobs, every draft is accepted from the
    first step (17 drafts in 23 tokens after the prefill's, 3 + 1 a step), and the prefill wrote
    the target's KV (and state) plus the drafter's KV (`draft_kv_bytes` of LENS)."""
    pytest.importorskip("mooncake.engine")
    ps = prompts(23, LENS)
    stack = start_stack(
        target,
        tmp_path,
        "--page-size",
        str(PS),
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        "24",
        prefill_args=spec_flags,
        decode_args=spec_flags,
    )
    try:
        metas = _greedy_through_router(stack.router, ps, reference, what)
        assert all(m["spec_accept_token_num"] == m["spec_draft_token_num"] == 17 for m in metas), metas
        stack.decode.wait_idle()
        p = stack.prefill.wait_idle()
        assert p["disaggregation"]["bytes_written"] == expected_bytes(target, LENS, PS, 1, 1) + draft_kv_bytes
    except AssertionError:
        print(stack.logs())
        raise
    finally:
        stack.close()


def check_tp2_through_router(
    target: Path,
    tmp_path: Path,
    flags: tuple[str, ...],
    reference: Reference,
    draft_kv_bytes: int,
    what: str,
) -> None:
    """TP 2 prefill and decode servers with `flags` (a drafter that predicts the target, 3 steps;
    chunked prefill, layer groups) behind sglang-router: greedy tokens and logprobs as colocated,
    every draft accepted from the first step (5 steps of 3 drafts and one of 2 after the prefill's
    token: 23 tokens), the bytes the target's KV as TP (2,2) moves it plus the drafter's KV once
    (`draft_kv_bytes` of LENS), every room succeeded, no TP worker survives."""
    ps = prompts(23, LENS)
    stack = start_tp_stack(target, tmp_path, 2, 2, flags)
    try:
        metas = _greedy_through_router(stack.router, ps, reference, what)
        got = [(m["spec_verify_ct"], m["spec_draft_token_num"], m["spec_accept_token_num"]) for m in metas]
        assert got == [(6, 17, 17)] * len(ps), got
        stack.decode.wait_idle(30)
        stack.prefill.wait_idle(30)
        st = disagg_stats(stack.prefill)
        assert (st["rooms_succeeded"], st["rooms_failed"]) == (len(ps), 0), st
        assert st["bytes_written"] == expected_bytes(target, LENS, PS, 2, 2) + draft_kv_bytes
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)
