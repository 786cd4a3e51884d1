"""Which recurrent-state snapshots a hybrid model's request takes, and in which slots: bookkeeping
for the hybrid prefix cache (kvpipe/cache/hybrid_radix_cache.py), no tensors.

A cached prefix is usable only with the state after its last token, so while a request runs, its
forwards copy that state (its own slot's, kvpipe/cache/recurrent_pool.py) into snapshot slots
at page-aligned positions where a later prompt may want to start (the copies happen inside the
forward: model/layers/gated_delta_net.py takes them from the row's one pass). Per request:
- `branch`: where its KV match outran the snapshots (the cache held the pages of a shared system
  prompt but no state at its end): a snapshot there makes the next prompt with that prefix a hit;
- chunk boundaries: where a chunked prefill's row ends inside the prompt (floored to a page), so a
  later prompt sharing a long prefix that ends before this one's end hits the deepest boundary it
  covers (SGLang's Mamba radix cache caches each chunk of an unfinished prompt). When no snapshot
  slot is free and none can be evicted, a later snapshot takes the request's shallowest committed
  chunk snapshot's slot (`recycle`): the deepest boundaries and the prompt end are worth most;
- `prompt_end`: the longest prefix a repeat of the prompt can hit, floor((len - 1) / ps) * ps;
- the latest aligned position past the prompt end (decode steps, a multi-turn conversation's next
  turn starts from it), in one slot that is overwritten as the request goes on.
Snapshots the running forward writes are `pending` until the scheduler commits that forward;
finish hands the `taken` ones to the cache (an abort hands none: it inserts nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReqSnapshots:
    restore: int | None  # snapshot slot of the cached prefix: its first forward starts from it
    branch: int  # token position to snapshot where the KV match outran the snapshots; 0: none
    prompt_end: int  # floor((prompt_len - 1) / page_size) * page_size
    taken: dict[int, int] = field(default_factory=dict)  # position -> slot, of committed forwards
    pending: list[tuple[int, int]] = field(default_factory=list)  # (position, slot) being written
    track: int | None = None  # the slot of the latest aligned position past the prompt end
    split: bool = True  # positions inside a forward's row too (else only where its row ends)
    prompt_len: int = 0  # a row ending before the prompt's end ends at a chunk boundary

    def positions(self, prefix_len: int, extend_len: int, page_size: int) -> list[int]:
        """Positions in (prefix_len, prefix_len + extend_len] a forward of these tokens snapshots."""
        start, end = prefix_len, prefix_len + extend_len
        out = {p for p in (self.branch, self.prompt_end) if start < p <= end}
        last = end - end % page_size
        if last > start and (last > self.prompt_end or end < self.prompt_len):
            out.add(last)  # past the prompt end (tracked), or a chunk boundary inside the prompt
        return sorted(out) if self.split else [end] if end in out else []

    def is_tracking(self, pos: int) -> bool:
        return pos > self.prompt_end

    def is_chunk(self, pos: int) -> bool:
        return pos < self.prompt_end and pos != self.branch

    def recycle(self, pos: int) -> int | None:
        """The slot of this request's shallowest committed chunk-boundary snapshot before `pos`
        (plan() then drops that snapshot), or None: when no slot is free, a deeper one is worth more."""
        older = [p for p in self.taken if self.is_chunk(p) and p < pos]
        return self.taken[min(older)] if older else None

    def plan(self, pos: int, slot: int) -> None:
        """The running forward writes the state at `pos` into `slot` (a tracking slot reused: its
        older position is gone)."""
        self.taken = {p: s for p, s in self.taken.items() if s != slot}
        self.pending.append((pos, slot))

    def commit(self) -> None:
        """The forward finished: what it wrote is valid."""
        self.taken.update(self.pending)
        self.pending.clear()

    def release(self, keep: bool) -> tuple[dict[int, int], list[int]]:
        """At finish: (snapshots for the cache, slots to free). keep=False (an abort): none kept."""
        taken = dict(self.taken) if keep else {}
        slots = {s for _, s in self.pending} | set(self.taken.values())
        if self.track is not None:
            slots.add(self.track)
        self.taken, self.pending, self.track = {}, [], None
        return taken, sorted(slots - set(taken.values()))
