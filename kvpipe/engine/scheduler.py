"""Continuous batching with chunked prefill over Req objects and a PageAllocator (no tensors).

Policy (simple and fair):
- One step is either a prefill batch or a decode batch. Prefill goes first,
  but never twice in a row while decoders wait, so a stream of long prompts cannot stall
  running generations for more than one step and new prompts are never starved either.
  With `mixed_chunk` (--enable-mixed-chunk, as SGLang's) a step that prefills also carries one
  token of every decoding request (a MIXED batch: prompt rows, then decode rows), and their
  tokens count against the step's budget; a step with nothing to prefill stays a plain decode.
  Decoders then advance at every step while prompts are computed, riding on weights the prefill
  reads anyway (CPU decode is weight-bandwidth-bound: its rows cost little in a prefill forward),
  and no step is spent on a decode alone while prompts wait (issue 51: TTFT under load).
- A prefill batch first continues partially prefilled requests, then admits waiting ones in
  FIFO order (head-of-line: no overtaking), up to a token budget of
  min(max_prefill_tokens, chunked_prefill_size). With chunking, the last row takes what is
  left of the budget, so a prompt spans several steps; without, prompts go whole. A request
  whose stored prefix pages the KV tier is fetching (cache/store_tier.py) is passed over until
  the fetch ends (bounded): it never holds up the queue or the running requests' steps.
- Pages are allocated lazily, per step, for exactly the tokens that step writes
  (request_pages.py: each admitted request's promise and pages). Admission is conservative
  instead: a request is admitted only if the pages it could ever need (prompt +
  max_new_tokens - 1 tokens) fit in the free pages minus those promised to admitted requests.
  Running requests therefore never run out of pages, and nothing is preempted; the rest wait
  in the queue. A request that could never fit is finished with ABORT.

Seams for disaggregation (driven by the engine for its KV connector, never by the connector):
`reserve` + `add_prefilled` (a request whose KV another server wrote goes straight to decode),
`whole_prompt_pages` (a prompt's pages are allocated at its first chunk, so a PD prefill can
hand the whole page table to its transfer), and held pages (`finish(..., hold=True)` keeps a
finished request's pages, and the cached prefix it pinned, until `release(rid)`).

Prefix cache (optional RadixCache): admission, and `reserve`, match the prompt minus its last
token (whose logits give the first output token) against the cache; the matched pages become
req.pages[:num_shared_pages], pinned and read-only, and only the other pages count against the
pool. A request's full pages of KV it computed (or, reserved, that a verified transfer wrote:
num_cached grows only at `add_prefilled`) go to the cache when its pages are freed.

Hybrid models (a HybridRadixCache): a cached prefix is usable only with a snapshot of the
recurrent state at its end, so a match stops at the deepest node holding one; the request's first
forward copies that state into its slot, and its forwards snapshot the state at the positions
engine/state_snapshots.py picks (into slots the cache hands out, evicting old snapshots when none
is free, or skipping the snapshot when all are pinned). At finish the cache takes its pages up to
its deepest snapshot, and the snapshots; an aborted request gives it nothing (engine/hybrid_state.py).

Sliding-window models (`window`): the sliding layers keep a second page table per request,
req.swa_pages, from the same allocator (the pool aliases a sliding and a full layer's buffers,
cache/kv_pool.py). It is allocated per step for the pages the step's queries can see, and after each
step the pages the window slid past are freed, so a request holds at most
`window_page_bound` of them however long it generates; admission promises that many. A reserved
(PD decode) request gets window pages for the prompt's last window only: that is all the
prefill sends. With a prefix cache (an SWARadixCache) a hit also restores the window pages before
it, and a request keeps the windows before the points a later prompt may start at, for the cache
(engine/window_cache.py). A reserved request's hit is its full-layer match (it computes nothing):
of the prompt's last window it takes the cache's pages and allocates, as its own, those the cache
lacks, below its prefix's end too (`Req.swa_own_shared`), for the writer to fill.

Speculative decoding (`drafter`): a decode row gets pages for its last token and its drafts (at
most max_new_tokens - outputs - 1 of them, so within its promise); after the verify forward
`commit_verify` keeps the accepted tokens and frees the pages past them (PageLedger.rollback).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.cache.store_tier import StoreTier
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_page_bound
from kvpipe.config import SchedulerConfig
from kvpipe.engine.batch import ForwardMode, ScheduledBatch
from kvpipe.engine.hybrid_state import cache_snapshots, free_state_slot, match_state, plan_state, state_stats
from kvpipe.engine.request import FinishReason, Req, ReqStatus
from kvpipe.engine.request_pages import PageLedger
from kvpipe.engine.spec.verify import draft_budget
from kvpipe.engine.window_cache import (
    match_full,
    match_window,
    window_promise,
)

# speculative decoding: (request, most drafts it may get) -> its draft tokens for this step
Drafter = Callable[[Req, int], list[int]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: PageAllocator,
        page_size: int,
        context_length: int,
        whole_prompt_pages: bool = False,
        prefix_cache: RadixCache | None = None,
        state_slots: StateSlotAllocator | None = None,
        window: int | None = None,
        drafter: Drafter | None = None,
        max_drafts: int = 0,
        mixed_chunk: bool = False,
    ) -> None:
        self.cfg = cfg
        # MIXED steps (--enable-mixed-chunk): the engine allows them where a forward can take decode
        # rows beside prompt rows (no KV connector, drafter or recurrent state)
        if mixed_chunk and (drafter is not None or state_slots is not None):
            raise ValueError("mixed prefill/decode steps take no drafter and no recurrent state")
        self.mixed_chunk = mixed_chunk
        # speculative decoding: each decode row verifies the drafts `drafter` proposes (at most
        # max_drafts, never past max_new_tokens); commit_verify then keeps the accepted ones
        self.drafter = drafter
        self.max_drafts = max_drafts
        if (window is not None and prefix_cache is not None) != isinstance(prefix_cache, SWARadixCache):
            raise ValueError("a sliding-window model's prefix cache must be an SWARadixCache, and only such a model's")
        self.window = window  # sliding-window layers' window (tokens): they get window pages
        self.cache = prefix_cache
        # hybrid models: each admitted request holds one recurrent-state slot, from admission
        # (like its promised pages) until its pages are freed
        self.state_slots = state_slots
        self.allocator = allocator
        self.page_size = page_size
        self.context_length = context_length
        self.whole_prompt_pages = whole_prompt_pages
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted: prefilling (maybe in chunks) or decoding
        self.reserved: dict[str, Req] = {}  # pages reserved, KV being written by someone else
        self.held: dict[str, Req] = {}  # finished, pages kept until release(rid)
        self._live: dict[str, Req] = {}  # every unfinished request: waiting, running, reserved
        self._last_was_prefill = False
        self.prefix_hit_tokens = 0  # prompt tokens admitted requests took from the prefix cache
        # the pages each admitted request was promised and holds (request_pages.py)
        self.pages = PageLedger(allocator, page_size, prefix_cache, window)

    @property
    def kv_tier(self) -> StoreTier | None:
        """A KV tier shared with other servers (cache/store_tier.py; engine/store_setup.py sets it)."""
        return self.pages.kv_tier

    @kv_tier.setter
    def kv_tier(self, tier: StoreTier | None) -> None:
        self.pages.kv_tier = tier

    # ---- admission -------------------------------------------------------------------------
    def max_pages(self, req: Req) -> int:
        """Pages for the most KV a request can write: prompt + max_new_tokens - 1 tokens."""
        tokens = len(req.input_ids) + max(req.params.max_new_tokens - 1, 0)
        return _cdiv(max(tokens, 1), self.page_size)

    def window_pages(self, req: Req) -> int:
        """Most sliding-layer pages `req` holds at once (0 without sliding layers): the window
        plus its longest step (a whole prompt, or a chunk)."""
        if self.window is None:
            return 0
        n = len(req.input_ids)
        if self.cfg.chunked_prefill_size > 0:
            n = min(n, max(1, min(self.cfg.max_prefill_tokens, self.cfg.chunked_prefill_size)))
        if self.drafter is not None:  # a verify step adds its last token and its drafts
            n = max(n, 1 + self.max_drafts)
        if isinstance(self.cache, SWARadixCache):  # it keeps window pages for the cache too
            return min(self.max_pages(req), window_promise(self.window, n, self.page_size))
        return min(self.max_pages(req), window_page_bound(self.window, n, self.page_size))

    def _reject_reason(self, req: Req) -> str | None:
        n, m = len(req.input_ids), req.params.max_new_tokens
        if n == 0:
            return "the prompt is empty"
        if n + m > self.context_length:
            return (
                f"the prompt ({n} tokens) plus max_new_tokens ({m}) exceeds the context length "
                f"({self.context_length} tokens)"
            )
        need = self.max_pages(req) + self.window_pages(req)
        if need > self.allocator.num_pages:
            window = f" (with {self.window_pages(req)} for the sliding window)" if self.window else ""
            return (
                f"the prompt ({n} tokens) plus max_new_tokens ({m}) needs {need} KV "
                f"pages of {self.page_size} tokens{window}; the KV cache holds only {self.allocator.num_pages}"
            )
        return None

    def _can_admit(self, req: Req, outstanding: int) -> bool:
        if self.state_slots is not None and self.state_slots.num_free == 0:
            return False  # it waits for a finishing request's state slot, as for pages
        need = self.max_pages(req) - req.num_shared_pages + self.window_pages(req)
        return need <= self.pages.available() - outstanding

    def _match_prefix(self, req: Req, reserved: bool = False) -> None:
        """Start `req` at its longest cached prefix (at least its last prompt token is computed:
        its logits give the first output token); the matched pages are pinned. `reserved`: its KV
        is written by someone else (a PD decode), which needs no window before the prefix's end."""
        if self.cache is None or req.cache_node is not None:
            return
        if isinstance(self.cache, HybridRadixCache):
            pages, node = match_state(self.cache, req, self.page_size)
        elif isinstance(self.cache, SWARadixCache):
            match = match_full if reserved else match_window
            pages, node = match(self.cache, req, self.page_size)
        else:
            pages, node = self.cache.match(req.cache_ids(req.input_ids[:-1]))
        self.cache.lock(node)
        req.cache_node = node
        req.pages = pages.copy()
        req.num_shared_pages = len(pages)
        req.num_cached = req.cached_tokens = len(pages) * self.page_size

    def _tier_ready(self, req: Req) -> bool:
        """False while the KV tier fetches stored pages past `req`'s radix match (bounded by its
        fetch timeout): `req` stays queued, other requests' steps go on; then they are in the cache."""
        if self.kv_tier is None or self.cache is None or req.cache_node is not None or req.cache_salt is not None:
            return True  # a salted prompt skips the tier: its keys have no tenant (docs/security.md, cache_salt)
        return self.kv_tier.ready(req.rid, req.input_ids[:-1], self.cache, self.allocator)

    def waiting_on_tier(self) -> bool:
        """Every waiting request waits for the KV tier's prefetch (nothing to schedule for them yet)."""
        tier = self.kv_tier
        return tier is not None and bool(self.waiting) and all(tier.pending(r.rid) for r in self.waiting)

    def _promise(self, req: Req) -> int:
        """Admit `req`: promise the pages it may still allocate (its cached prefix aside), give it a
        state slot (hybrid models); returns the pages promised."""
        if self.state_slots is not None:
            req.state_slot = self.state_slots.alloc(req.rid)
            assert req.state_slot is not None, "_can_admit checked for a free slot"
        promised = self.max_pages(req) - req.num_shared_pages + self.window_pages(req)
        self.pages.promise(req, promised)
        self.prefix_hit_tokens += req.num_shared_pages * self.page_size
        return promised

    def _unmatch(self, req: Req) -> None:
        """Give back a prefix match (the request stays queued)."""
        self.pages.unpin(req)
        req.pages = np.zeros(0, dtype=np.int64)
        req.num_cached = req.cached_tokens = 0
        req.snapshots = None  # nothing planned yet: no slots to give back
        req.swa_pages = np.zeros(0, dtype=np.int64)  # the cache's window pages, if any
        req.swa_own_shared = np.zeros(0, dtype=np.int64)
        req.swa_hit_points = ()

    def add(self, req: Req) -> bool:
        """Queue a request. Returns False if it can never run (then it is finished with ABORT)."""
        if req.rid in self._live:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if not self._track(req):
            return False
        self.waiting.append(req)
        return True

    def _track(self, req: Req) -> bool:
        """Make `req` live (idempotent); False, with req finished as ABORT, if it can never run."""
        if req.rid not in self._live:
            if req.rid in self.held:
                raise ValueError(f"request id {req.rid!r} is already in use")
            req.status = ReqStatus.WAITING
            self._live[req.rid] = req
        reason = self._reject_reason(req)
        if reason is not None:
            self.finish(req, FinishReason.ABORT, reason)
            return False
        return True

    def reserve(self, req: Req) -> bool:
        """Allocate pages for a prompt whose KV someone else will write (decode side of PD).

        True: req.pages covers the prompt (a cached prefix first: req.num_shared_pages pages
        the writer must skip) and the rest of its pages are promised. False: no room now (retry
        later), or never (then req is finished with ABORT; check req.finished).
        """
        if not self._track(req):
            return False
        if len(self.running) + len(self.reserved) >= self.cfg.max_running_requests:
            return False
        if not self._tier_ready(req):
            return False  # stored pages are on their way: retry later
        self._match_prefix(req, reserved=True)
        if not self._can_admit(req, self.pages.outstanding()):
            self._unmatch(req)
            return False
        self._promise(req)
        self.pages.ensure(req, len(req.input_ids))
        # the first decode step (position len(prompt)) sees the prompt's last window only
        self.pages.ensure_window(req, len(req.input_ids), len(req.input_ids))
        self.reserved[req.rid] = req
        return True

    def add_prefilled(self, req: Req) -> None:
        """A reserved request whose prompt KV is now in its pages and whose first token is known."""
        if self.reserved.pop(req.rid, None) is None:
            raise ValueError(f"request {req.rid!r} has no reserved pages")
        if not req.output_ids:
            raise ValueError(f"request {req.rid!r} enters decode without its first output token")
        req.num_cached = len(req.input_ids)
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next batch to run, or None when there is nothing runnable."""
        has_decoders = any(r.prefill_done for r in self.running)
        if self.mixed_chunk and has_decoders:
            mixed = self._schedule_prefill(with_decoders=True)
            return mixed if mixed is not None else self._schedule_decode()
        if not (has_decoders and self._last_was_prefill):
            batch = self._schedule_prefill()
            if batch is not None:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        return self._schedule_decode() if has_decoders else None

    def _schedule_prefill(self, with_decoders: bool = False) -> ScheduledBatch | None:
        """Prompt rows under the step's token budget; `with_decoders`: a MIXED batch, every decoding
        request's next token after them (their tokens taken from the budget first), or None when
        no prompt row fits."""
        chunking = self.cfg.chunked_prefill_size > 0
        budget = self.cfg.max_prefill_tokens
        if chunking:
            budget = min(budget, self.cfg.chunked_prefill_size)
        decoders = [r for r in self.running if r.prefill_done] if with_decoders else []
        budget = max(budget - len(decoders), 1)  # a prompt row always gets a token
        batch = ScheduledBatch(ForwardMode.MIXED if with_decoders else ForwardMode.PREFILL, [], [], [])

        def take(req: Req) -> None:
            nonlocal budget
            remaining = len(req.input_ids) - req.num_cached
            n = min(remaining, budget) if chunking else remaining
            self.pages.ensure(req, len(req.input_ids) if self.whole_prompt_pages else req.num_cached + n)
            self.pages.ensure_window(req, req.num_cached, req.num_cached + n)
            self._plan_state(req, batch, len(batch.reqs), req.num_cached, n)
            batch.reqs.append(req)
            batch.extend_lens.append(n)
            batch.prefix_lens.append(req.num_cached)
            budget -= n

        for req in self.running:
            if budget <= 0:
                break
            if not req.prefill_done:
                take(req)
        outstanding = self.pages.outstanding()
        at = 0  # the first waiting request not waiting for the KV tier's prefetch
        room = self.cfg.max_running_requests
        while len(self.waiting) > at and budget > 0 and len(self.running) + len(self.reserved) < room:
            req = self.waiting[at]
            if not self._tier_ready(req):
                at += 1  # its stored pages are on their way (bounded): the next one may go first
                continue
            self._match_prefix(req)
            if (not chunking and batch.reqs and len(req.input_ids) - req.num_cached > budget) or not self._can_admit(
                req, outstanding
            ):
                self._unmatch(req)
                break  # FIFO: later requests do not overtake the head
            del self.waiting[at]
            outstanding += self._promise(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            take(req)
            outstanding -= self.pages.own_pages(req)
        if not batch.reqs:
            return None
        for req in decoders:  # after the prompt rows: their pages were promised at admission
            self._decode_row(req, batch, [])
        return batch

    def _schedule_decode(self) -> ScheduledBatch:
        reqs = [r for r in self.running if r.prefill_done]
        drafts = [self._draft(r) for r in reqs]
        batch = ScheduledBatch(
            ForwardMode.DECODE,
            reqs,
            [1 + len(d) for d in drafts],
            [r.num_cached for r in reqs],
            drafts=drafts if self.drafter is not None else [],
        )
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            self._decode_row(r, batch, d, i)
        return batch

    def _decode_row(self, r: Req, batch: ScheduledBatch, drafts: list[int], row: int | None = None) -> None:
        """Pages for decode row `r` (its last token and `drafts`); appended to `batch` unless it is
        already row `row` (a DECODE batch is built whole)."""
        if row is None:
            row = len(batch.reqs)
            batch.reqs.append(r)
            batch.extend_lens.append(1 + len(drafts))
            batch.prefix_lens.append(r.num_cached)
        self.pages.ensure(r, r.num_cached + 1 + len(drafts))
        self.pages.ensure_window(r, r.num_cached, r.num_cached + 1 + len(drafts))
        # hybrid prefix cache: the snapshot after the last token only, which is always kept; those
        # after accepted drafts are planned once acceptance is known (engine/spec/state_rollback.py)
        self._plan_state(r, batch, row, r.num_cached, 1)

    def _draft(self, req: Req) -> list[int]:
        if self.drafter is None:
            return []
        k = draft_budget(self.max_drafts, req.params.max_new_tokens, len(req.output_ids))
        return [int(t) for t in self.drafter(req, k)[:k]] if k > 0 else []

    def _plan_state(self, req: Req, batch: ScheduledBatch, row: int, start: int, n: int) -> None:
        """Hybrid prefix cache: the state copies of `req`'s forward of tokens [start, start + n)."""
        if isinstance(self.cache, HybridRadixCache):
            plan_state(self.cache, self.allocator, req, batch, row, start, n, self.page_size)

    # ---- results and lifecycle -------------------------------------------------------------
    def commit(self, batch: ScheduledBatch, tokens: Sequence[int | None], logprobs: Sequence[float | None]) -> None:
        """Record a finished forward: KV of every row is cached; rows with a token grow by it."""
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            start, n = batch.prefix_lens[i], batch.extend_lens[i]
            req.num_cached = start + n
            if req.snapshots is not None:
                req.snapshots.commit()
            self.pages.slide(req)
            token, logprob = tokens[i], logprobs[i]
            if token is None:
                continue
            if req.params.max_new_tokens > 0:
                req.output_ids.append(int(token))
                req.output_logprobs.append(float(logprob) if logprob is not None else 0.0)

    def commit_verify(
        self,
        req: Req,
        prefix_len: int,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        stops: Callable[[Req], bool],
    ) -> int:
        """Record a verify step of decode row `req` (spec_verify.py): append `tokens` (its accepted
        drafts and the bonus token) one by one until `stops(req)` says the last one ended it; the
        KV of its inputs up to the last appended token's is kept, the rest rolled back (pages
        past it go back to the allocator, so no later step reads a rejected draft's KV and no
        page leaks). Returns the tokens appended."""
        n = 0
        for token, logprob in zip(tokens, logprobs):
            req.output_ids.append(int(token))
            req.output_logprobs.append(float(logprob))
            n += 1
            if stops(req):
                break
        # inputs x_0 .. x_{n-1} (the last token and the accepted drafts) have valid KV; the last
        # appended token, as after any decode step, has none yet
        req.num_cached = prefix_len + n
        self.pages.slide(req)
        self.pages.rollback(req)
        return n

    def finish(self, req: Req, reason: FinishReason, detail: str | int | None = None, hold: bool = False) -> None:
        """End a request (idempotent). Its pages are freed exactly once: now, or with hold=True
        at release(rid)."""
        if req.finished:
            return
        self._live.pop(req.rid, None)
        self.pages.withdraw(req.rid)
        if self.kv_tier is not None:
            self.kv_tier.forget(req.rid)
        self.reserved.pop(req.rid, None)
        # by identity: Req is a dataclass whose == compares fields (numpy pages among them)
        if any(r is req for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r is not req)
        self.running = [r for r in self.running if r is not req]
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.finish_detail = detail
        if req.pages.size == 0:
            self.pages.unpin(req)
            free_state_slot(self.state_slots, req)
            if isinstance(self.cache, HybridRadixCache):
                cache_snapshots(self.cache, req, np.zeros(0, dtype=np.int64))
            return
        if hold:  # a cached prefix stays pinned too: the transfer reads (prefill) or skips (decode) it
            self.held[req.rid] = req
        else:
            self._free(req)

    def abort(self, rid: str, message: str = "aborted", hold: bool = False) -> Req | None:
        """Finish a waiting, reserved or running request with ABORT; None if rid is not live."""
        req = self._live.get(rid)
        if req is not None:
            self.finish(req, FinishReason.ABORT, message, hold)
        return req

    def release(self, rid: str) -> bool:
        """Free the pages a finished request held (finish(..., hold=True)). False if none."""
        req = self.held.pop(rid, None)
        if req is None:
            return False
        self._free(req)
        return True

    def _free(self, req: Req) -> None:
        """Return a finished request's pages (PageLedger.free) and its recurrent-state slot."""
        self.pages.free(req)
        free_state_slot(self.state_slots, req)

    def get(self, rid: str) -> Req | None:
        return self._live.get(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int]:
        decoding = sum(1 for r in self.running if r.prefill_done)
        return {
            "num_running": len(self.running),
            "num_prefilling": len(self.running) - decoding,
            "num_decoding": decoding,
            "num_waiting": len(self.waiting),
            "num_reserved": len(self.reserved),
            "num_held": len(self.held),
            # pages a new request can get: free ones and cached ones no running request reads
            "free_pages": self.pages.available(),
            "used_pages": self.allocator.num_pages - self.pages.available(),
            "cached_pages": self.pages.cached_pages(),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "total_pages": self.allocator.num_pages,
            "page_size": self.page_size,
            **state_stats(self.state_slots, self.cache),
        }
