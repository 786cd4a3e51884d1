"""What the scheduler hands the runner (ScheduledBatch) and what crosses to TP ranks (ForwardSpec).

ScheduledBatch holds live Req objects (rank 0 only). ForwardSpec is its plain, picklable
description: the new tokens, prefix lengths and page tables of every row, enough for any TP
rank to build the same ForwardBatch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpipe.engine.request import Req


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # prompt tokens (a whole prompt or one chunk of it) of one or more requests
    DECODE = "decode"  # one token for every running decoder
    # prefill rows (whole prompts or chunks) followed by one token for every running decoder
    # (--enable-mixed-chunk); the model takes it as a prefill batch whose decode rows extend by 1
    MIXED = "mixed"


@dataclass(frozen=True)
class ForwardSpec:
    """Plain data (lists, numpy) sent to every TP rank once per step."""

    token_ids: tuple[list[int], ...]  # new tokens of each row
    prefix_lens: tuple[int, ...]  # tokens of each row already in the KV pool
    page_tables: tuple[np.ndarray, ...]  # int64 pages covering prefix + new tokens of each row
    want_logits: tuple[bool, ...]  # rows whose last token is sampled
    layer_groups: tuple[tuple[int, int], ...] | None = None  # [start, end) layer ranges; None: one pass
    connector_meta: Any = None  # the KV connector's plan for this forward, for every rank's worker
    state_slots: tuple[int, ...] | None = None  # each row's StatePool slot (hybrid models); None: no state
    # sliding-window models: each row's sliding-layer pages, like page_tables (-1: slid out, never
    # read); None: no sliding layers
    swa_page_tables: tuple[np.ndarray, ...] | None = None
    # speculative verify: logits for each row's last logit_counts[i] tokens (its last token and
    # drafts); None: one (the last token's) for every row with want_logits
    logit_counts: tuple[int, ...] | None = None
    # hybrid prefix cache: (snapshot slot, row's slot) copied before the forward (a cached prefix's
    # state), and (row, k, slot): the state of the row's slot after its first k new tokens
    # copied into snapshot slot `slot` during it (engine/state_snapshots.py)
    state_restores: tuple[tuple[int, int], ...] = ()
    state_snapshots: tuple[tuple[int, int, int], ...] = ()
    # hybrid speculative decoding (cache/verify_states.py): (slot, j, dst) copies of the last verify
    # forward's per-position states applied before this forward (first of all state copies), and
    # whether this forward is a verify that keeps each row's per-position states
    state_commits: tuple[tuple[int, int, int], ...] = ()
    verify_states: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per row
    prefix_lens: list[int]  # tokens per row already cached before this step
    # speculative decode rows: the draft tokens each row verifies after its last token (its
    # extend_len is 1 + len(drafts[i])); empty: no speculation in this batch
    drafts: list[list[int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # as ForwardSpec's
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)  # as ForwardSpec's
    state_commits: list[tuple[int, int, int]] = field(default_factory=list)  # as ForwardSpec's

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def is_prompt_row(self, i: int) -> bool:
        """Row i computes prompt tokens (a prefill row; a MIXED batch's decode rows are not)."""
        return self.prefix_lens[i] < len(self.reqs[i].input_ids)

    def completes_prefill(self, i: int) -> bool:
        """Row i reaches the end of its prompt (or is a decode row): its last token is sampled."""
        return self.prefix_lens[i] + self.extend_lens[i] >= len(self.reqs[i].input_ids)

    def spec(
        self, page_size: int, layer_groups: tuple[tuple[int, int], ...] | None = None, connector_meta: Any = None
    ) -> ForwardSpec:
        toks, tables, swa = [], [], []
        drafts = self.drafts or [[] for _ in self.reqs]
        for req, pre, n, draft in zip(self.reqs, self.prefix_lens, self.extend_lens, drafts):
            m = n - len(draft)  # tokens of the request itself; the drafts follow them
            ids = req.input_ids[pre : pre + m] if pre + m <= len(req.input_ids) else req.all_ids[pre : pre + m]
            toks.append(list(ids) + list(draft))
            used = -(-(pre + n) // page_size)
            tables.append(np.ascontiguousarray(req.pages[:used], dtype=np.int64))
            swa.append(np.ascontiguousarray(req.swa_pages[:used], dtype=np.int64))
        slots = [r.state_slot for r in self.reqs]
        state_slots = tuple(int(s) for s in slots if s is not None)
        return ForwardSpec(
            tuple(toks),
            tuple(self.prefix_lens),
            tuple(tables),
            tuple(self.completes_prefill(i) for i in range(len(self.reqs))),
            layer_groups,
            connector_meta,
            state_slots if len(state_slots) == len(slots) else None,
            tuple(swa) if any(t.size for t in swa) else None,
            logit_counts=tuple(1 + len(d) for d in self.drafts) if self.drafts else None,
            state_restores=tuple(self.state_restores),
            state_snapshots=tuple(self.state_snapshots),
            state_commits=tuple(self.state_commits),
            verify_states=bool(self.drafts) and len(state_slots) == len(slots) and bool(slots),
        )
