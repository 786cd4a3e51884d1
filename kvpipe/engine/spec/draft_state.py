"""A hybrid STANDALONE draft model's recurrent state per request (bookkeeping, no tensors): which
of the draft StatePool's slots a request holds and how many of its tokens the state has seen.

The draft's KV rolls back by itself (draft_book.py: positions past the valid prefix are
overwritten), its recurrent state does not: after a step's chain of drafts it has seen drafts
that may be rejected. So each request holds two slots: `base`, the state after its first
`base_len` tokens (true tokens only: what the catch-up forwards saw), and `work`, a copy of
`base` that the chain forwards advance over the drafts and that is thrown away. The next step
catches up from `base` (on the accepted drafts and the bonus token, a few tokens, in one extend
forward) instead of picking the state at the accepted position, which keeps the draft's forwards
free of per-position states at the cost of recomputing the accepted drafts.

PD: the prefill does not move a hybrid draft's state (nor its KV): the decode's first step
catches up on the whole prompt, as a colocated engine's first step does (DraftModel.reserve_prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.cache.recurrent_slots import StateSlotAllocator


@dataclass
class DraftStateSlots:
    base: int
    work: int
    base_len: int = 0  # tokens the base state has seen (0: none, the next catch-up starts fresh)


class DraftStates:
    def __init__(self, running_slots: int) -> None:
        """Two slots per running request: the draft StatePool holds 2 * running_slots."""
        self.slots = StateSlotAllocator(2 * running_slots)
        self.seqs: dict[str, DraftStateSlots] = {}

    def get(self, rid: str) -> DraftStateSlots | None:
        """The request's slots, allocated on first use; None when none are free."""
        s = self.seqs.get(rid)
        if s is not None:
            return s
        base = self.slots.alloc(rid)
        if base is None:
            return None
        work = self.slots.alloc(rid)
        if work is None:
            self.slots.free(base)
            return None
        s = self.seqs[rid] = DraftStateSlots(base, work)
        return s

    def base_len(self, rid: str) -> int:
        s = self.seqs.get(rid)
        return 0 if s is None else s.base_len

    def release(self, rid: str) -> None:
        """The request ended: its slots go back (idempotent)."""
        s = self.seqs.pop(rid, None)
        if s is not None:
            self.slots.free(s.base)
            self.slots.free(s.work)
