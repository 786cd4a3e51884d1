"""A hybrid model's speculative verify forward (model/layers/gated_delta_net.py `_verify`,
cache/verify_states.py): rows of several inputs after their prompts compute each input as plain
decode steps do (logits, and the state after every input kept per position), the row's slot ends
at its last input, a rollback copy puts the state of an earlier input back (the next decode step
then gives the logits of decoding from there), and a snapshot inside a verify row holds the state
after its input. Also StateRollback's bookkeeping (engine/spec/state_rollback.py)."""

from __future__ import annotations

import pytest
import torch

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.verify_states import VerifyStates
from kvpipe.engine.request import Req, ReqStatus, SamplingParams
from kvpipe.engine.spec.state_rollback import StateRollback
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.forward_batch import ForwardBatch
from tests.helpers.tolerance import assert_close_logits

pytest.importorskip("transformers.models.qwen3_5")

from tests.helpers.hf_models import prompt_ids, save  # noqa: E402
from tests.helpers.hybrid_model import hf_qwen3_5, pools  # noqa: E402

PS = 4
SLOTS = 4  # running slots 0, 1; 2, 3 as snapshot slots


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save(hf_qwen3_5(), tmp_path_factory.mktemp("qwen3_5")))


def prefill(model, prompts, tables, kv, state):
    batch = ForwardBatch.build(prompts, [0, 0], tables, PS, state_slots=[0, 1])
    model(batch, kv, state)


def slot_state(state, slot) -> list[torch.Tensor]:
    """Every layer's conv and recurrent state of one slot (copies)."""
    return [t[slot].clone() for pair in zip(state.conv, state.recurrent) for t in pair]


def kept_state(keep: VerifyStates, slot: int, j: int) -> list[torch.Tensor]:
    """Every layer's state after input j of slot's last verify row, as slot_state orders them."""
    return [t[slot, j] for pair in zip(keep.conv, keep.recurrent) for t in pair]


def assert_states(got, want, cfg, positions: int) -> None:
    """States computed in another order of the same arithmetic: the logits' bound (tolerance.py)."""
    for g, w in zip(got, want, strict=True):
        assert_close_logits(g.float(), w.float(), cfg, positions)


@torch.no_grad()
def test_verify_rows_compute_as_decode_steps_and_roll_back(model):
    cfg = model.cfg
    prompts = [prompt_ids(9, seed=1), prompt_ids(14, seed=2)]
    follow = [prompt_ids(4, seed=3), prompt_ids(2, seed=4)]  # row 0: 4 inputs, row 1: 2
    tables = [torch.arange(0, 5), torch.arange(5, 10)]
    n = max(len(p) for p in prompts) + 4
    # plain decoding: one decode step per input, both rows together while both have one
    kv, state = pools(model, 10, PS, slots=SLOTS)
    prefill(model, prompts, tables, kv, state)
    want_logits: list[list[torch.Tensor]] = [[], []]
    want_states: list[list[list[torch.Tensor]]] = [[], []]
    for j in range(4):
        rows = [r for r in (0, 1) if j < len(follow[r])]
        batch = ForwardBatch.build(
            [[follow[r][j]] for r in rows],
            [len(prompts[r]) + j for r in rows],
            [tables[r] for r in rows],
            PS,
            state_slots=rows,
        )
        assert batch.decode is not None
        out = model(batch, kv, state)
        for i, r in enumerate(rows):
            want_logits[r].append(out[i])
            want_states[r].append(slot_state(state, r))
    # one verify forward of both rows, a snapshot after row 0's second input into slot 2
    kv2, state2 = pools(model, 10, PS, slots=SLOTS)
    keep = state2.keep_verify_states(2, 5)
    prefill(model, prompts, tables, kv2, state2)
    verify = ForwardBatch.build(
        follow,
        [len(p) for p in prompts],
        tables,
        PS,
        state_slots=[0, 1],
        logit_counts=[4, 2],
        state_snapshots=[(0, 2, 2)],
        verify_states=True,
    )
    got = model(verify, kv2, state2)
    assert_close_logits(got, torch.cat([torch.stack(w) for w in want_logits]), cfg, n)
    for r in (0, 1):
        for j, want in enumerate(want_states[r]):
            assert_states(kept_state(keep, r, j), want, cfg, n)
        last = len(follow[r]) - 1
        assert all(torch.equal(a, b) for a, b in zip(slot_state(state2, r), kept_state(keep, r, last)))
    assert all(torch.equal(a, b) for a, b in zip(slot_state(state2, 2), kept_state(keep, 0, 1)))
    # row 0 kept 2 inputs (1 draft accepted): roll back; its next decode step is plain decoding's
    state2.commit_verify([(0, 1, 0)])
    assert all(torch.equal(a, b) for a, b in zip(slot_state(state2, 0), kept_state(keep, 0, 1)))
    kv3, state3 = pools(model, 10, PS, slots=SLOTS)
    prefill(model, prompts, tables, kv3, state3)
    nxt = prompt_ids(1, seed=5)
    for ids, pre in ((follow[0][:2], len(prompts[0])), (nxt, len(prompts[0]) + 2)):
        want = model(ForwardBatch.build([ids], [pre], [tables[0]], PS, state_slots=[0]), kv3, state3)
    step = ForwardBatch.build([nxt], [len(prompts[0]) + 2], [tables[0]], PS, state_slots=[0])
    assert_close_logits(model(step, kv2, state2), want, cfg, n)
    # a verify row longer than the buffers' positions is refused
    long_row = prompt_ids(6, seed=6)
    too_long = ForwardBatch.build(
        [long_row], [len(prompts[0])], [tables[0]], PS, state_slots=[0], logit_counts=[6], verify_states=True
    )
    with pytest.raises(ValueError, match="positions"):
        model(too_long, kv2, state2)


def test_state_rollback_bookkeeping():
    """A row that kept every input needs no copy; one that kept fewer gets its slot's state after
    its last kept input back at the next forward, unless it finished meanwhile."""
    params = SamplingParams(max_new_tokens=8)
    reqs = [Req(f"r{i}", [5, 6, 7], params) for i in range(3)]
    for slot, r in enumerate(reqs):
        r.state_slot = slot
    rb, alloc = StateRollback(), PageAllocator(8)
    rb.verified(reqs[0], 10, 4, 4, None, alloc, PS)
    rb.verified(reqs[1], 10, 4, 2, None, alloc, PS)
    rb.verified(reqs[2], 10, 3, 1, None, alloc, PS)
    reqs[2].status = ReqStatus.FINISHED
    assert rb.take() == [(1, 1, 1)]
    assert rb.take() == []
    with pytest.raises(ValueError, match="kept"):
        rb.verified(reqs[0], 10, 3, 0, None, alloc, PS)
