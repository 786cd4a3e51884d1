"""Prefill-side bookkeeping of one room: destinations, queued send calls, per-layer send cursors.

Plain Python/numpy, no sockets and no backend: `KVSender` owns the threads and I/O and drives a
`SenderRoom` under its lock; this file turns `send()` calls into coalesced write batches.

Pages. `src_pages[i]` holds prompt tokens [i*ps, (i+1)*ps) on prefill. A destination (one decode
rank) holds the first `prefix_len` tokens already (page aligned) and gave `dst_pages[j]` for
request page `prefix_len // ps + j`. Each destination keeps one cursor per layer: tokens whose
pages of that layer are already planned. A send call (token_end, layers [a, b)) plans, per run of
layers with equal cursors, the pages `planner.sendable_pages` allows: full pages only, a trailing
partial page waits for the next chunk, and `last=True` flushes every layer up to token_end
(layer-pipelined prefill: the earlier layer groups of the final chunk get their partial page too).

Staged sends (heterogeneous TP through the decode's staging ring, staging/buffers.py): when the policy
says so, a planned span becomes `StagedChunk`s instead of page ops, each at most the policy's
chunk size; staged_sends.py walks them through gather, slot, write, scatter.

Sliding-window layers (KVLayout.swa_layers): their pages come from the room's window page table
`src_swa_pages` (aligned with src_pages by logical page, -1 where the prefill holds none, shorter:
not allocated yet) into the destination's `dst_swa_pages` (aligned with dst_pages, -1 where the
decode wants none). A run of layers with equal cursors plans its full layers over every span page
and its sliding layers over the span pages the decode asked for only, each in one vectorised
call; the cursor moves past the skipped pages too, so every page moves at most once. A decode
with a cached prefix may also want window pages below it (`dst_swa_lead`: the prompt's last
window reaches back into the prefix, whose window pages it lacks): a sliding layer's go with the
first call that moves its cursor (its KV is computed past the prefix then; the prefill holds
every page of its prompt's last window until the room ends). Such rooms are never staged (a chunk
is a contiguous layer range over one page list).

Recurrent state (hybrid models, recurrent/layout.py): a call may also carry the final state of some
linear layers (`state_layers`, the prompt's last forward has passed them); the last call writes
every linear layer not written yet. Each destination remembers which layers it got, so the state
of a layer moves once (recurrent/plan.py: 2 ops, or 4 for a head slice under heterogeneous TP) from
the room's slot into the decode's slot, queued with the room's KV batches, so the room's final
status still follows it.

Draft KV (STANDALONE speculative decoding, disagg/draft_transfer.py): the draft model's pool is a
second layout (`draft_layout`, its own buffers and head shape, the target's page size) with its
own page tables, `src_draft_pages` here and `dst_draft_pages` on the decode, both from logical
page 0 (the decode holds no draft prefix, whatever its prefix_len). Its layers come after the
target's in send() calls: draft layer i is send layer num_layers + i, so a send call over layers
[num_layers, num_send_layers) is the last layer group and a last call flushes it like any layer.
Heterogeneous TP: the draft's heads pair up by the target's rank mapping over the draft's own head
count (`Destination.draft_heads`), each page's head slice one op per (layer, K/V, page run) of the
head-major layout. Never staged (the staging ring carries the target's layers only).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpipe.transfer.control.messages import AuxData
from kvpipe.transfer.lifecycle import RoomRecord, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.planner import plan_pages, sendable_pages, staging_pays
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.recurrent.plan import plan_state
from kvpipe.transfer.sender.plan_types import (
    Destination,
    Inflight,
    OpBatch,
    PlanError,
    SendCall,
    StagedChunk,
    StagingPolicy,
    equal_runs,
)


@dataclass
class SenderRoom:
    room: int
    rec: RoomRecord
    layout: KVLayout  # this prefill rank's pool
    state_layout: StateLayout | None = None  # this prefill rank's state pool (hybrid models)
    src_pages: np.ndarray | None = None  # None until the engine called add_room
    src_state_slot: int | None = None  # the room's state slot here (hybrid models), from add_room
    src_swa_pages: np.ndarray | None = None  # [<= len(src_pages)] int64 window page table, -1: none held
    expected: int | None = None  # destinations to wait for; known from the first request
    claim: bytes | None = None  # the room's prompt claim (add_room; claims.py); None: the first decode's
    dests: dict[str, Destination] = field(default_factory=dict)  # by decode session id
    calls: collections.deque[SendCall] = field(default_factory=collections.deque)
    token_end: int = 0  # highest token_end passed to send()
    last_called: bool = False
    aux: AuxData | None = None
    queued: collections.deque[OpBatch] = field(default_factory=collections.deque)  # planned, not submitted
    staged: dict[int, StagedChunk] = field(default_factory=dict)  # staged chunks not yet finished, by id
    inflight: list[Inflight] = field(default_factory=list)
    submitting: int = 0  # batches taken off `queued` by the worker, not yet recorded as inflight
    notified: set[str] = field(default_factory=set)  # sessions that got our final TransferStatus
    ops_planned: int = 0
    ops_done: int = 0
    bytes_done: int = 0
    # transfer time: seconds with at least one of this room's batches taken and not yet finished
    busy_s: float = 0.0
    busy_since: float | None = None
    first_submit_at: float | None = None
    last_done_at: float | None = None
    requested_at: float | None = None  # every decode destination's page table had arrived (timelines)
    # (start, end) of each stretch with some of its writes in flight: one per layer group where the
    # link keeps up with the compute (request timelines)
    busy_spans: list[tuple[float, float]] = field(default_factory=list)
    reported: bool = False  # poll() handed the outcome to the engine
    draft_layout: KVLayout | None = None  # this prefill rank's draft-model pool (STANDALONE)
    src_draft_pages: np.ndarray | None = None  # the room's draft page table (None: no draft KV here)

    @property
    def num_send_layers(self) -> int:
        """Layers of send() calls: the target's KV layers, then the draft model's."""
        return self.layout.num_layers + (self.draft_layout.num_layers if self.draft_layout is not None else 0)

    @property
    def draft_tokens(self) -> int:
        """Prompt tokens whose draft KV this room sends (its aux data tells the decode)."""
        return self.token_end if self.draft_layout is not None and self.src_draft_pages is not None else 0

    @property
    def ready(self) -> bool:
        """Every destination is known and the engine admitted the room: planning may start."""
        return self.src_pages is not None and self.expected is not None and len(self.dests) >= self.expected

    @property
    def drained(self) -> bool:
        """No write of this room is queued or in flight and no staged chunk is still being
        gathered or scattered: its source pages may be reused, its decode pages are settled."""
        return not self.queued and not self.inflight and not self.submitting and not self.staged

    @property
    def complete(self) -> bool:
        return self.ready and self.last_called and not self.calls and self.drained

    @property
    def waiting_on_compute(self) -> bool:
        """The next queued call waits for its `ready` event."""
        return bool(self.calls) and self.calls[0].ready is not None

    def mark_busy(self, now: float) -> None:
        """A batch of this room was taken for submission."""
        if self.busy_since is None:
            self.busy_since = now
        if self.first_submit_at is None:
            self.first_submit_at = now

    def mark_idle_if_drained(self, now: float) -> None:
        """Close the busy interval once nothing of this room is in flight."""
        if self.busy_since is not None and not self.inflight and not self.submitting:
            self.busy_s += max(0.0, now - self.busy_since)
            self.busy_spans.append((self.busy_since, now))
            self.busy_since = None
            self.last_done_at = now

    def add_call(self, call: SendCall) -> None:
        if self.last_called:
            raise PlanError(f"room {self.room}: send() after the last chunk")
        n_layers = self.num_send_layers
        # a hybrid model's layer group may hold no full-attention layer: no KV, maybe state
        empty_ok = self.state_layout is not None
        j0, j1 = call.state_layers
        if not (
            0 <= call.token_start <= call.token_end
            and 0 <= call.layer_start <= call.layer_end <= n_layers
            and (call.layer_start < call.layer_end or empty_ok)
            and 0 <= j0 <= j1 <= (self.state_layout.num_linear if self.state_layout else 0)
        ):
            raise PlanError(
                f"room {self.room}: bad send range tokens [{call.token_start}, {call.token_end}) "
                f"layers [{call.layer_start}, {call.layer_end}) of {n_layers}, state layers [{j0}, {j1})"
            )
        if self.src_pages is not None and -(-call.token_end // self.layout.page_size) > self.src_pages.size:
            raise PlanError(
                f"room {self.room}: {call.token_end} tokens need more than the "
                f"{self.src_pages.size} source pages given to add_room"
            )
        if self.src_draft_pages is not None and -(-call.token_end // self.layout.page_size) > self.src_draft_pages.size:
            raise PlanError(
                f"room {self.room}: {call.token_end} tokens need more than the "
                f"{self.src_draft_pages.size} draft pages given to add_room"
            )
        self.token_end = max(self.token_end, call.token_end)
        self.last_called = call.last
        self.calls.append(call)

    def plan(self, chunk_ops: int, staging: StagingPolicy | None = None, chunk_ids: Iterator[int] | None = None) -> int:
        """Turn queued calls into write batches of at most `chunk_ops` ops (and, with a staging
        policy, staged chunks with ids from `chunk_ids`); returns ops planned (a chunk is one op)."""
        if staging is not None and chunk_ids is None:
            raise ValueError("staged planning needs the sender's chunk id counter")
        if not self.ready or self.rec.state is TransferState.FAILED:
            return 0
        planned = 0
        while self.calls:
            if self.calls[0].ready is not None and not self.calls[0].ready():
                break  # its layers are still being computed; later calls come after it
            call = self.calls.popleft()
            for dest in self.dests.values():
                for batch in self._plan_dest(call, dest, staging, chunk_ids):
                    if isinstance(batch, StagedChunk):
                        self.staged[batch.chunk] = batch
                        planned += 1
                        continue
                    for i in range(0, batch.num_ops, chunk_ops):
                        sl = slice(i, i + chunk_ops)
                        self.queued.append(OpBatch(batch.peer, batch.src[sl], batch.dst[sl], batch.length[sl]))
                    planned += batch.num_ops
        self.ops_planned += planned
        return planned

    def _plan_dest(
        self, call: SendCall, dest: Destination, staging: StagingPolicy | None, chunk_ids: Iterator[int] | None
    ) -> list[OpBatch | StagedChunk]:
        # dest.heads None: another prefill rank writes the replicated KV head; the linear heads
        # are never replicated, so this rank may still owe the state of its own heads
        out = [] if dest.heads is None else self._plan_kv(call, dest, staging, chunk_ids)
        # the draft model's heads pair up on their own: this rank may owe them where it owes no target head
        n_kv = self.layout.num_layers
        a, b = (0, self.num_send_layers) if call.last else (call.layer_start, call.layer_end)
        if b > n_kv:
            end_tok = self.token_end if call.last else call.token_end
            out.extend(self._plan_draft(dest, max(a, n_kv), b, end_tok, call.last))
        state = self._plan_state(call, dest)
        if state is not None:
            out.append(state)
        return out

    def _plan_kv(
        self, call: SendCall, dest: Destination, staging: StagingPolicy | None, chunk_ids: Iterator[int] | None
    ) -> list[OpBatch | StagedChunk]:
        assert self.src_pages is not None
        ps = self.layout.page_size
        n_kv = self.layout.num_layers
        a, b = (0, self.num_send_layers) if call.last else (call.layer_start, call.layer_end)
        layers = (a, min(b, n_kv))  # the target's layers; the draft's [n_kv, b) go below
        end_tok = self.token_end if call.last else call.token_end
        if -(-end_tok // ps) > self.src_pages.size:
            raise PlanError(f"room {self.room}: {end_tok} tokens need more than {self.src_pages.size} source pages")
        first_dst_page = dest.prefix_len // ps
        swa = np.asarray(self.layout.swa_mask, dtype=bool)
        out: list[OpBatch | StagedChunk] = []
        for l0, l1, cur in equal_runs(dest.cursor, *layers):
            if cur >= end_tok:  # decode holds these tokens already, or they went with an earlier call
                continue
            if dest.dst_swa_lead is not None and swa[l0:l1].any():
                out.extend(self._plan_lead(dest, l0, l1, swa))
            span = sendable_pages(cur, end_tok, ps, final=call.last)
            dest.cursor[l0:l1] = span.token_end
            if span.num_pages == 0:
                continue
            j0, j1 = span.first - first_dst_page, span.end - first_dst_page
            if j1 > dest.dst_pages.size:
                raise PlanError(
                    f"room {self.room}: decode rank {dest.decode_rank} gave {dest.dst_pages.size} "
                    f"pages after its {dest.prefix_len}-token prefix, {end_tok} tokens need {j1}"
                )
            src, dst = self.src_pages[span.first : span.end], dest.dst_pages[j0:j1]
            if not swa[l0:l1].any():
                out.extend(self._plan_span(dest, src, dst, staging, chunk_ids, layers=(l0, l1)))
                continue
            ids = np.arange(l0, l1)
            full = ids[~swa[l0:l1]]
            if full.size:
                out.extend(self._plan_span(dest, src, dst, None, None, layer_ids=full))
            if dest.dst_swa_pages is None:  # SenderPeers.check_request refuses such a request
                raise PlanError(f"room {self.room}: decode rank {dest.decode_rank} named no sliding-window pages")
            src_w, dst_w = self._window_pages(dest, span.first, dest.dst_swa_pages[j0:j1])
            if dst_w.size:
                out.extend(self._plan_span(dest, src_w, dst_w, None, None, layer_ids=ids[swa[l0:l1]]))
        return out

    def _plan_draft(self, dest: Destination, a: int, b: int, end_tok: int, final: bool) -> list[OpBatch]:
        """The draft model's KV of send layers [a, b) (draft layers [a - num_layers, b - num_layers))
        up to token end_tok, by the same cursor rule as the target's, the destination's draft heads
        only (heterogeneous TP: a head slice of each page, one op per (layer, K/V, page run)); nothing
        for a destination that asked for no draft KV, whose draft heads another prefill rank sends,
        or a room without draft pages here (its aux says 0 tokens)."""
        if dest.draft_layout is None or dest.dst_draft_pages is None or dest.draft_heads is None:
            return []
        if self.draft_layout is None or self.src_draft_pages is None:
            return []
        n_kv, ps = self.layout.num_layers, self.layout.page_size
        out = []
        for l0, l1, cur in equal_runs(dest.cursor, a, b):
            if cur >= end_tok:
                continue
            span = sendable_pages(cur, end_tok, ps, final=final)
            dest.cursor[l0:l1] = span.token_end
            if span.num_pages == 0:
                continue
            if span.end > dest.dst_draft_pages.size:
                raise PlanError(
                    f"room {self.room}: decode rank {dest.decode_rank} gave {dest.dst_draft_pages.size} draft "
                    f"pages, {end_tok} tokens need {span.end}"
                )
            src = self.src_draft_pages[span.first : span.end]
            dst = dest.dst_draft_pages[span.first : span.end]
            try:
                layers = (l0 - n_kv, l1 - n_kv)
                p = plan_pages(src, dst, self.draft_layout, dest.draft_layout, heads=dest.draft_heads, layers=layers)
            except ValueError as e:
                raise PlanError(f"room {self.room}: draft KV: {e}") from e
            out.append(OpBatch(dest.data_address, p.src_addr, p.dst_addr, p.length))
        return out

    def _plan_lead(self, dest: Destination, l0: int, l1: int, swa: np.ndarray) -> list[OpBatch | StagedChunk]:
        """The window pages below the decode's prefix (dest.dst_swa_lead) of the sliding layers in
        [l0, l1) that did not get them yet: the caller's call moves their cursor, so their KV is
        computed past the prefix (or was cached on the prefill), these pages included."""
        assert dest.dst_swa_lead is not None and dest.swa_lead_sent is not None
        todo = np.flatnonzero(swa[l0:l1] & ~dest.swa_lead_sent[l0:l1]) + l0
        if todo.size == 0:
            return []
        dest.swa_lead_sent[todo] = True
        first = dest.prefix_len // self.layout.page_size - dest.dst_swa_lead.size
        src, dst = self._window_pages(dest, first, dest.dst_swa_lead)
        if dst.size == 0:
            return []
        return list(self._plan_span(dest, src, dst, None, None, layer_ids=todo))

    def _window_pages(self, dest: Destination, first: int, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) sliding-window pages of the decode's window pages `dst` (logical pages from
        `first`, -1: not wanted): the ones the decode asked for; the prefill must hold each of them."""
        pos = np.flatnonzero(dst >= 0)  # [k] positions wanted, relative to j0
        held = self.src_swa_pages if self.src_swa_pages is not None else np.zeros(0, dtype=np.int64)
        logical = first + pos
        src = np.full(pos.size, -1, dtype=np.int64)
        inside = logical < held.size
        src[inside] = held[logical[inside]]
        if (src < 0).any():
            k = int(logical[np.flatnonzero(src < 0)[0]])
            raise PlanError(
                f"room {self.room}: prefill holds no sliding-window page for logical page {k} "
                f"the decode rank {dest.decode_rank} asked for"
            )
        return src, dst[pos]

    def _plan_span(
        self,
        dest: Destination,
        src: np.ndarray,
        dst: np.ndarray,
        staging: StagingPolicy | None,
        chunk_ids: Iterator[int] | None,
        layers: tuple[int, int] | None = None,
        layer_ids: np.ndarray | None = None,
    ) -> Sequence[OpBatch | StagedChunk]:
        """Page ops of src -> dst over `layers` (or `layer_ids`), or staged chunks when the policy says so."""
        try:
            p = plan_pages(src, dst, self.layout, dest.layout, heads=dest.heads, layers=layers, layer_ids=layer_ids)
        except ValueError as e:
            raise PlanError(f"room {self.room}: {e}") from e
        sliced = not (p.head_end - p.head_start == self.layout.kv_heads == dest.layout.kv_heads)
        if layers is not None and self._stages(p.num_ops, p.nbytes // max(1, p.num_ops), sliced, dest, staging):
            assert staging is not None and chunk_ids is not None
            return self._stage(dest, src, dst, p.head_start, p.head_end, *layers, staging, chunk_ids)
        return [OpBatch(dest.data_address, p.src_addr, p.dst_addr, p.length)]

    def _plan_state(self, call: SendCall, dest: Destination) -> OpBatch | None:
        """The state of the call's linear layers (the last call: all) that `dest` lacks."""
        if self.state_layout is None or dest.state_layout is None or dest.state_sent is None:
            return None
        if self.src_state_slot is None or dest.state_slot is None:
            raise PlanError(f"room {self.room}: a hybrid model's room needs a state slot on both sides")
        j0, j1 = (0, self.state_layout.num_linear) if call.last else call.state_layers
        todo = np.flatnonzero(~dest.state_sent[j0:j1]) + j0
        if todo.size == 0:
            return None
        dest.state_sent[todo] = True
        try:
            p = plan_state(self.src_state_slot, dest.state_slot, self.state_layout, dest.state_layout, todo)
        except ValueError as e:
            raise PlanError(f"room {self.room}: {e}") from e
        return OpBatch(dest.data_address, p.src_addr, p.dst_addr, p.length)

    def _stages(
        self, num_ops: int, op_nbytes: int, sliced: bool, dest: Destination, staging: StagingPolicy | None
    ) -> bool:
        """on: every head-sliced span; auto: whenever the ops cost more than staging them (head
        slices, or whole pages scattered over a fragmented decode pool). Never for a layout
        with sliding-window layers (a chunk is one layer range over one page list)."""
        if staging is None or dest.staging is None or num_ops == 0 or self.layout.swa_layers:
            return False
        if staging.mode == "on":
            return sliced
        return staging_pays(num_ops, op_nbytes)

    def _stage(
        self,
        dest: Destination,
        src: np.ndarray,
        dst: np.ndarray,
        h0: int,
        h1: int,
        l0: int,
        l1: int,
        staging: StagingPolicy,
        chunk_ids: Iterator[int],
    ) -> list[StagedChunk]:
        """Split layers [l0, l1) x pages into chunks of at most staging.chunk_nbytes each."""
        assert dest.staging is not None
        head = self.layout.head_nbytes
        ncols = (h1 - h0) * head
        limit = min(staging.chunk_nbytes, dest.staging.pool_nbytes // 4)  # a few chunks in flight per ring
        per_page = (l1 - l0) * 2 * ncols  # one page over every layer of the span
        if per_page <= limit:
            layer_steps, pages_per = [(l0, l1)], limit // per_page
        else:  # one page over all the layers is too big: a chunk per layer (or fewer)
            layer_steps, pages_per = [(a, a + 1) for a in range(l0, l1)], limit // (2 * ncols)
        if pages_per == 0:
            raise PlanError(
                f"room {self.room}: one page's {2 * ncols}-byte head slice of one layer is larger "
                f"than the staging chunk limit ({limit} bytes: the staging buffers are too small)"
            )
        out = []
        for a, b in layer_steps:
            for i in range(0, src.size, pages_per):
                out.append(
                    StagedChunk(
                        next(chunk_ids),
                        dest.session_id,
                        src[i : i + pages_per],
                        dst[i : i + pages_per],
                        (h0 - self.layout.head_start) * head,
                        (h0 - dest.layout.head_start) * head,
                        ncols,
                        a,
                        b,
                    )
                )
        return out
