"""The scheduler with a hybrid prefix cache (no model): which state snapshots each forward takes
(the branch point, chunk boundaries, the prompt end, the latest aligned position past it), the restore a hit's first
forward does, what a finished request leaves in the cache, that an abort leaves nothing, and that
every page, state slot and snapshot slot is accounted for after every step."""

from __future__ import annotations

import numpy as np

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.config import SchedulerConfig
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.engine.scheduler import Scheduler

PS = 4
RUNNING = 2


def make(snapshots: int = 6, pages: int = 64, chunk: int = 0, split: bool = True) -> Scheduler:
    cache = HybridRadixCache(PS, StateSlotAllocator(snapshots, first=RUNNING), split)
    cfg = SchedulerConfig(chunked_prefill_size=chunk, max_running_requests=RUNNING)
    return Scheduler(cfg, PageAllocator(pages), PS, 4096, prefix_cache=cache, state_slots=StateSlotAllocator(RUNNING))


def hybrid(s: Scheduler) -> HybridRadixCache:
    assert isinstance(s.cache, HybridRadixCache)
    return s.cache


def check(s: Scheduler) -> None:
    """Every page is the cache's or one running request's own; every snapshot slot the cache's or
    one request's; state slots are the running requests'."""
    cache = hybrid(s)
    own = [r.pages[r.num_shared_pages :] for r in s.running]
    allp = np.concatenate([cache.all_pages(), *own])
    assert np.unique(allp).size == allp.size == s.allocator.num_used
    req_snaps = [slot for r in s.running if r.snapshots for slot in snapshot_slots(r)]
    held = cache.all_snapshots() + req_snaps
    assert len(set(held)) == len(held) == cache.snapshots.num_used
    assert sorted(r.state_slot for r in s.running) == sorted(s.state_slots.in_use())


def snapshot_slots(r: Req) -> set[int]:
    snap = r.snapshots
    assert snap is not None
    return (
        set(snap.taken.values())
        | {slot for _, slot in snap.pending}
        | ({snap.track} if snap.track is not None else set())
    )


def step(s: Scheduler) -> ScheduledBatch | None:
    """One step of a fake model (token = 100 + seq_len); finish at max_new_tokens."""
    b = s.schedule()
    if b is None:
        return None
    toks = [100 + r.seq_len if b.completes_prefill(i) else None for i, r in enumerate(b.reqs)]
    s.commit(b, toks, [0.0 if t is not None else None for t in toks])
    for r, t in zip(b.reqs, toks):
        if t is not None and len(r.output_ids) >= r.params.max_new_tokens:
            s.finish(r, FinishReason.LENGTH)
    check(s)
    return b


def run(s: Scheduler, *reqs: Req) -> list[ScheduledBatch]:
    for r in reqs:
        s.add(r)
    out = []
    while (b := step(s)) is not None:
        out.append(b)
    return out


def req(rid: str, ids: list[int], max_new: int = 3) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new))


def test_a_finished_request_leaves_its_prompt_end_and_last_aligned_state():
    s = make()
    a = req("a", list(range(1, 11)), max_new=4)  # 10 tokens: prompt end 8, then 10 + 3 = 13 cached
    batches = run(s, a)
    prefill = batches[0]
    assert prefill.state_restores == [] and prefill.state_snapshots[0][:2] == (0, 8)
    # decode steps: positions 10, 11, 12 -> 13 cached; only the step to 12 is page-aligned
    decode_snaps = [(b.prefix_lens[0], b.state_snapshots) for b in batches[1:]]
    assert [p for p, sn in decode_snaps if sn] == [11] and all(sn[0][1] == 1 for _, sn in decode_snaps if sn)
    cache = hybrid(s)
    assert cache.num_snapshots == 2 and cache.num_pages == 3  # pages to position 12, its deepest snapshot
    assert s.allocator.num_used == 3 and s.state_slots.num_free == RUNNING


def test_a_repeat_restores_the_snapshot_and_computes_only_the_rest():
    s = make()
    prompt = list(range(1, 11))
    run(s, req("a", prompt))
    snap_slot = hybrid(s).match_state(prompt[:-1]).snapshot
    assert snap_slot is not None
    b = req("b", prompt)
    s.add(b)
    first = step(s)
    assert first is not None and first.prefix_lens == [8] and first.extend_lens == [2] and b.cached_tokens == 8
    assert first.state_restores == [(snap_slot, b.state_slot)] and first.spec(PS).state_restores == (
        (snap_slot, b.state_slot),
    )
    assert all(not x.state_restores for x in run(s))
    assert s.prefix_hit_tokens == 8


def test_a_shared_prefix_gets_a_snapshot_at_its_branch_point():
    s = make()
    system = list(range(50, 59))  # 9 tokens: 2 whole pages shared
    run(s, req("a", system + [1, 2, 3, 4]))
    b = req("b", system + [5, 6, 7, 8, 9])
    batches = run(s, b)
    assert b.cached_tokens == 0  # KV for 8 tokens is there, but no state at 8
    positions = sorted(batches[0].prefix_lens[0] + k for _, k, _ in batches[0].state_snapshots)
    assert positions == [8, 12]  # the branch point and the prompt end
    c = req("c", system + [10, 11])
    run(s, c)
    assert c.cached_tokens == 8


def test_multi_turn_hits_the_last_aligned_state_of_the_previous_turn():
    s = make()
    t1 = req("t1", list(range(1, 8)), max_new=6)  # 7 + 6 - 1 = 12 cached: a state at 12
    run(s, t1)
    t2 = req("t2", t1.all_ids + [90, 91, 92])
    run(s, t2)
    assert t2.cached_tokens == 12


def test_chunked_prefill_snapshots_mid_chunk_and_restores_once():
    s = make(chunk=5)
    prompt = list(range(1, 15))  # 14 tokens in chunks of 5: prompt end 12 lies in the third chunk
    a = req("a", prompt)
    batches = run(s, a)
    got = [[b.prefix_lens[0] + k for _, k, _ in b.state_snapshots] for b in batches[:3]]
    assert got == [[4], [8], [12]]  # chunk boundaries 5 and 10 floored to pages, then 12 = 10 + 2 in
    b = req("b", prompt + [1, 2])
    batches = run(s, b)
    assert b.cached_tokens == 12 and [len(x.state_restores) for x in batches] == [1] + [0] * (len(batches) - 1)


def test_an_abort_inserts_nothing_and_frees_everything():
    s = make()
    a = req("a", list(range(1, 11)), max_new=8)
    s.add(a)
    step(s)
    step(s)
    assert a.snapshots is not None and a.snapshots.taken
    s.abort("a")
    cache = hybrid(s)
    assert cache.num_pages == 0 and cache.num_snapshots == 0 and cache.snapshots.num_used == 0
    assert s.allocator.num_used == 0 and s.state_slots.num_free == RUNNING


def test_a_failed_forward_leaves_no_half_written_snapshot():
    s = make()
    prompt = list(range(1, 11))
    a = req("a", prompt)
    s.add(a)
    b = s.schedule()  # planned, never committed: the forward "failed"
    assert b is not None and b.state_snapshots
    s.finish(a, FinishReason.ABORT, "forward failed")
    assert hybrid(s).num_snapshots == 0 and hybrid(s).snapshots.num_used == 0 and s.allocator.num_used == 0


def test_few_snapshot_slots_evict_old_states_and_skip_when_pinned():
    s = make(snapshots=1, pages=16)
    prompts = [[k] * 9 + list(range(1, 6)) for k in range(1, 6)]  # unrelated 14-token prompts
    for i, p in enumerate(prompts):
        run(s, req(f"r{i}", p, max_new=2))
        assert hybrid(s).num_snapshots <= 1
    last = req("again", prompts[-1])
    run(s, last)
    assert last.cached_tokens == 12  # the most recent one survived
    # two requests at once, one slot: the second's snapshot is skipped, nothing breaks
    x, y = req("x", [7] * 14), req("y", [8] * 14)
    run(s, x, y)
    assert hybrid(s).num_snapshots == 1 and s.allocator.num_used == hybrid(s).num_pages
    assert s.stats()["cached_state_snapshots"] == 1 and s.stats()["free_snapshot_slots"] == 0


def test_no_buffer_snapshots_only_where_a_row_ends():
    """--mamba-scheduler-strategy no_buffer: no split of a row; a chunk or decode step that ends on
    a page boundary at a wanted position still snapshots."""
    s = make(chunk=4, split=False)
    a = req("a", list(range(1, 11)), max_new=4)  # chunks [0,4) [4,8) [8,10): a boundary, the prompt end
    batches = run(s, a)
    ends = [(b.prefix_lens[0] + b.extend_lens[0], b.state_snapshots) for b in batches]
    assert [e for e, sn in ends if sn] == [4, 8, 12] and all(
        sn[0][1] == 4 if e in (4, 8) else sn[0][1] == 1 for e, sn in ends if sn
    )
    s = make(split=False)
    b = req("b", list(range(1, 11)), max_new=2)  # one row [0, 10): 8 lies inside it, 12 is never reached
    assert all(not x.state_snapshots for x in run(s, b)) and hybrid(s).num_pages == 0


def snapshot_positions(s: Scheduler) -> list[int]:
    cache = hybrid(s)
    return sorted(cache.depth(n) * PS for n in cache._nodes() if n.snapshot is not None)


def test_a_long_prefix_hits_the_deepest_chunk_boundary_it_shares():
    """A prompt prefilled in chunks keeps a snapshot at each chunk boundary: a later prompt that
    shares more than a chunk but not the whole prompt starts at the deepest boundary it covers."""
    s = make(chunk=8)
    a = req("a", list(range(1, 31)))  # 30 tokens: rows end at 8, 16, 24; prompt end 28
    batches = run(s, a)
    assert [[b.prefix_lens[0] + k for _, k, _ in b.state_snapshots] for b in batches[:4]] == [[8], [16], [24], [28]]
    assert snapshot_positions(s) == [8, 16, 24, 28, 32]  # 32: the last aligned state of decode
    b = req("b", list(range(1, 22)) + [99] * 6)  # shares 21 tokens (5 pages): deepest boundary 16
    batches = run(s, b)
    assert b.cached_tokens == 16 and batches[0].prefix_lens == [16]
    c = req("c", list(range(1, 22)) + [98] * 6)  # b left a snapshot at its branch point, 20
    run(s, c)
    assert c.cached_tokens == 20


def test_chunk_snapshots_recycle_their_own_slots_when_none_is_free():
    """Two snapshot slots for a prompt of four chunk boundaries: each later snapshot takes the
    slot of the request's shallowest committed chunk snapshot, so the deepest boundary and the
    prompt end survive; every slot is accounted for after every step (check)."""
    s = make(snapshots=2, chunk=4)
    a = req("a", list(range(1, 23)))  # 22 tokens: boundaries 4, 8, 12, 16; prompt end 20; decode to 24
    run(s, a)
    assert snapshot_positions(s) == [20, 24] and hybrid(s).snapshots.num_free == 0
    b = req("b", list(range(1, 23)) + [7])
    run(s, b)
    assert b.cached_tokens == 20
