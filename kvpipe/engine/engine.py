"""The engine: tokenizer, scheduler, model runner (or TP group), sampler, finish logic, and an
optional KV connector (kvpipe/engine/connector.py) through which PD disaggregation plugs in.

One thread calls step() in a loop; add_request/abort may come from any thread and land in the
one lock-protected inbox that step() drains first. `poll_interval()` tells the loop when the
next step has something to do (now, after a transfer poll interval, or only on new input).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeGuard, cast

import torch

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import ParallelConfig, ServerConfig
from kvpipe.engine.batch import ForwardMode, ForwardSpec, ScheduledBatch
from kvpipe.engine.connector import (
    Admission,
    ConnectorContext,
    ForwardPlan,
    KVArrived,
    KVConnector,
    KVConnectorWorker,
    TransferFinished,
)
from kvpipe.engine.connector_workers import RankWorkers
from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.model_runner import ModelRunner, snapshot_slots, split_layers, state_slots
from kvpipe.engine.request import ABORTED_ON_REQUEST, FinishReason, Req, SamplingParams, TokenOutput, finish_reason_json
from kvpipe.engine.sampler import Sampler, make_generator
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.spec.draft_model import DraftModel, check_draft_model
from kvpipe.engine.spec.eagle_drafter import EagleDrafter, check_eagle
from kvpipe.engine.spec.mtp_drafter import MTPDrafter, check_nextn
from kvpipe.engine.spec.ngram_drafter import propose_ngram
from kvpipe.engine.spec.sampling import speculative_sample
from kvpipe.engine.spec.state_rollback import StateRollback
from kvpipe.engine.spec.verify import SpecCounts, accepted_prefix
from kvpipe.engine.store_setup import attach_store_tier
from kvpipe.engine.timeline import Phase, TimelineRecord
from kvpipe.engine.tp_group import TPGroup, build_runner
from kvpipe.model.checkpoint.loader import load_generation_eos
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A REMOTE request waiting for free pages is retried this often when nothing else wakes the loop.
RESERVE_RETRY_S = 0.01
TIER_POLL_S = 0.005  # how often an idle engine checks a KV-tier prefetch (cache/store_tier.py)


def _one_prompt(
    prompts_or_ids: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
) -> TypeGuard[str | Sequence[int]]:
    """generate()'s argument is one prompt (text, or token ids), not a list of them."""
    return isinstance(prompts_or_ids, str) or bool(prompts_or_ids and isinstance(prompts_or_ids[0], int))


def _final_record(req: Req) -> TimelineRecord | None:
    """The timeline that goes with a finished request's output (None while it runs)."""
    return req.timeline.record() if req.finished else None


@dataclass
class _Held:
    """A finished request whose pages a transfer still owns (see connector.py)."""

    req: Req
    replied: bool  # the client got its final output
    deferred: TokenOutput | None = None  # the normal finish, sent once the transfer succeeded


class Engine:
    def __init__(self, cfg: ServerConfig, connector: KVConnector | None = None, layer_groups: int = 1) -> None:
        """`layer_groups`: prefill forwards run as this many layer groups when no connector
        plans them (a colocated engine computes the same either way)."""
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model_path)
        self.tokenizer = Tokenizer.from_dir(
            cfg.tokenizer_path or cfg.model_path, extra_eos_ids=load_generation_eos(cfg.model_path)
        )
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(self.tokenizer.eos_token_ids + self.model_config.eos_token_ids)
        )
        self.context_length: int = cfg.scheduler.context_length or self.model_config.max_position_embeddings
        self.spec = cfg.speculative
        self.spec_counts = SpecCounts()  # the server's verify steps, drafts proposed and accepted
        check_speculative(cfg, self.model_config)
        self.page_size = cfg.cache.page_size
        self.connector = connector
        self._layer_groups = layer_groups
        self._wakeup: Callable[[], None] | None = None
        self._tp: TPGroup | None = None
        self._worker: KVConnectorWorker | None = None
        if self.model_config.hybrid is not None:
            snapshot_slots(cfg)  # a --max-mamba-cache-size without room for snapshots: refused before any rank starts
        if cfg.tp_size > 1:
            self._tp = TPGroup(cfg, connector.worker_factory if connector is not None else None)
            self.runner: ModelRunner = self._tp.runner
            device = self._tp.device
        else:
            device = cfg.device
            self.runner = build_runner(cfg, ParallelConfig(), device)
        # STANDALONE: the draft model and its own KV, sharded over the TP group like the target
        self.draft: DraftModel | None = None
        if self.spec.standalone_draft_path is not None:
            self.draft = DraftModel(cfg, self.model_config, device, self._tp)
        # NEXTN: the checkpoint's MTP layer, fed the target's hidden states of every forward
        self.mtp: MTPDrafter | None = None
        if self.spec.uses_mtp:  # EAGLE with a draft model path: an EAGLE head in the MTP layer's place
            drafter = EagleDrafter if self.spec.eagle_head_path is not None else MTPDrafter
            self.mtp = drafter(cfg, self.model_config, self.runner.model, self.runner.pool.num_pages, device)
            self.runner.capture_hidden = True
        # a PD prefill's draft model runs over each prompt chunk; its KV goes to the decode with the target's
        self._draft_prefill = (
            self.draft is not None
            and self.draft.moves_kv
            and connector is not None
            and cfg.disaggregation.mode == "prefill"
        )
        # NEXTN's MTP layer too, its KV and the last hidden state go with the target's (disagg/mtp_transfer.py)
        self._mtp_prefill = self.mtp is not None and connector is not None and cfg.disaggregation.mode == "prefill"
        self.allocator = PageAllocator(cfg.cache.pages(), cfg.cache.debug_checks)
        use_cache = cfg.cache.radix_cache and (connector is None or connector.prefix_cache)
        hybrid = self.model_config.hybrid is not None
        running_slots = state_slots(cfg.cache, cfg.scheduler)
        # state snapshots where prompts are computed: colocated, and on a PD prefill
        computes = connector is None or cfg.disaggregation.mode == "prefill"
        num_snapshots = snapshot_slots(cfg) if hybrid and computes else 0
        # a PD decode never computes a prompt: its cache needs only the KV of a prefix (the prefill
        # sends the KV past it and the prompt's final state whole), so a plain RadixCache
        kv_only = hybrid and cfg.disaggregation.mode == "decode"
        if use_cache and hybrid and num_snapshots == 0 and not kv_only:
            logger.info(
                "prefix caching (radix cache) is disabled for the hybrid model %s: no state snapshot "
                "slots (a connector other than PD's, or --max-mamba-cache-size)",
                cfg.model_path,
            )
            use_cache = False
        # sliding layers keep only their window's pages (scheduler.py): their prefix cache keeps
        # window pages where a hit may start, tombstones where they slid out (cache/swa_radix_cache.py)
        window = self.model_config.sliding_window if self.model_config.sliding_layers else None
        self.prefix_cache: RadixCache | None = None
        if use_cache and window is not None:
            self.prefix_cache = SWARadixCache(self.page_size, window)
        elif use_cache and num_snapshots:
            split = cfg.cache.mamba_scheduler_strategy != "no_buffer"
            slots = StateSlotAllocator(num_snapshots, running_slots)
            self.prefix_cache = HybridRadixCache(self.page_size, slots, split)
            pool = self.runner.state_pool
            assert pool is not None and pool.num_slots == running_slots + num_snapshots
            logger.info(
                "hybrid prefix cache: %d state snapshots of %d bytes each (--max-mamba-cache-size %d)",
                num_snapshots,
                pool.slot_nbytes,
                running_slots + num_snapshots,
            )
        elif use_cache:
            self.prefix_cache = RadixCache(self.page_size)
        self.state_slots = StateSlotAllocator(running_slots) if hybrid else None
        # a hybrid model's verify steps: the accepted position's state, committed by the next forward
        self._rollback = StateRollback() if hybrid and self.spec.enabled else None
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.allocator,
            self.page_size,
            self.context_length,
            whole_prompt_pages=connector is not None and connector.whole_prompt_pages,
            prefix_cache=self.prefix_cache,
            state_slots=self.state_slots,
            window=window,
            drafter=self._propose if self.spec.enabled else None,
            max_drafts=self.spec.max_drafts,
        )
        # the KV tier on a Mooncake Store (--enable-hierarchical-cache): the scheduler loads and stores pages
        self.store_tier = attach_store_tier(cfg, self.runner.pool, self.scheduler, tp=self._tp)
        self.sampler = Sampler(cfg.seed, device)
        self.finisher = FinishChecker(self.tokenizer, self.eos_token_ids, self.context_length)
        self._device = device
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' private RNG streams
        self._lock = threading.Lock()
        self._inbox: list[Req] = []
        self._aborts: list[str] = []
        self._active: set[str] = set()  # rids added whose pages are not all free yet (duplicate check)
        self._remote: deque[tuple[Req, float]] = deque()  # REMOTE requests waiting for pages, deadline
        self._held: dict[str, _Held] = {}
        self._closed = False
        if connector is not None:
            try:
                self._worker = connector.make_worker(
                    self.runner.pool, self.model_config.kv_cache_heads, self.runner.state_pool
                )
                draft_pool = self.draft.runner.pool if self.draft is not None and self.draft.moves_kv else None
                if self.mtp is not None:  # NEXTN: the MTP layer's KV pool moves as the draft's
                    draft_pool = self.mtp.pool
                connector.start(
                    ConnectorContext(
                        cfg,
                        self.model_config,
                        RankWorkers(self._worker, self._tp),
                        self._wake,
                        draft_pool=draft_pool,
                        draft_kv_heads=self.draft.model_config.kv_cache_heads if self.draft is not None else None,
                    )
                )
            except BaseException:
                self.shutdown()
                raise

    # ---- thread-safe entry points ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request (any thread). ValueError: its rid is still active, or the connector
        refuses it (e.g. PD bootstrap fields missing or in use)."""
        req.timeline.enabled = self.cfg.request_metrics  # --disable-request-metrics: nothing recorded
        req.timeline.mark(Phase.ARRIVED)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            if req.rid in self._active:
                raise ValueError(f"a request with rid {req.rid!r} is already running")
            if self.connector is not None:
                self.connector.claim(req)
            self._active.add(req.rid)
            self._inbox.append(req)

    def abort(self, rid: str) -> None:
        """Finish a request with ABORT at the next step (any thread); unknown rids are ignored."""
        with self._lock:
            self._aborts.append(rid)

    def set_wakeup(self, fn: Callable[[], None] | None) -> None:
        """`fn` (any thread) makes the loop that drives step() call it now; the connector calls it
        when transfer news arrived (the loop otherwise sleeps up to poll_interval())."""
        self._wakeup = fn

    def _wake(self) -> None:
        fn = self._wakeup
        if fn is not None:
            fn()

    def poll_interval(self) -> float | None:
        """When step() has something to do: 0.0 now; s > 0 after s seconds (only transfers are
        in flight, or requests wait for pages a transfer holds); None only on new input."""
        with self._lock:
            if self._inbox or self._aborts:
                return 0.0
        s = self.scheduler
        if s.running or (s.waiting and not self._held and not s.reserved and not self._remote):
            # requests waiting only for the KV tier's prefetch: look again shortly, do not spin
            return TIER_POLL_S if not s.running and s.waiting_on_tier() else 0.0
        hint = self.connector.wait_hint() if self.connector is not None else None
        if self._remote:
            hint = RESERVE_RETRY_S if hint is None else min(hint, RESERVE_RETRY_S)
        if s.waiting_on_tier():
            hint = TIER_POLL_S if hint is None else min(hint, TIER_POLL_S)
        return hint

    def has_work(self) -> bool:
        return self.poll_interval() is not None

    def stats(self) -> dict:
        s: dict[str, Any] = dict(self.scheduler.stats())
        with self._lock:
            s["num_waiting"] += len(self._inbox)
        s["num_waiting"] += len(self._remote)
        s.update(context_length=self.context_length, tp_size=self.cfg.tp_size, kv_cache_bytes=self.runner.pool.nbytes)
        if self.spec.enabled:
            c = self.spec_counts
            s.update(spec_verify_steps=c.verify_ct, spec_proposed_tokens=c.proposed, spec_accepted_tokens=c.accepted)
        if self.connector is not None:
            s.update(self.connector.stats())
        if self.store_tier is not None:
            s["kv_store"] = self.store_tier.stats()
        return s

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one scheduler step; returns the news of every request it touched ([] when idle)."""
        outs: list[TokenOutput] = []
        self._drain_inbox(outs)
        if self.connector is not None:
            self._reserve_remote(outs)
            self._poll_connector(outs)
            if outs:  # a first token that arrived with its KV goes out now, not after the next forward
                return outs
        batch = self.scheduler.schedule()
        if batch is None:
            return outs
        if batch.mode is ForwardMode.PREFILL:
            self._mark_scheduled(batch)
        try:
            logits = self._forward(batch)
        except Exception as e:
            # leave no half-run request behind: its pages go back (or to its transfer), the caller sees the error
            for req in batch.reqs:
                self._finish(req, FinishReason.ABORT, f"forward failed: {e}")
            raise
        if batch.drafts:  # a speculative decode step: every row verifies its drafts (maybe none)
            assert logits is not None
            outs.extend(self._commit_verify(batch, logits))
            return outs
        rows = [i for i, r in enumerate(batch.reqs) if batch.completes_prefill(i)]
        for i in rows:
            batch.reqs[i].timeline.mark(Phase.FIRST_TOKEN)
        tokens: list[int | None] = [None] * len(batch.reqs)
        logprobs: list[float | None] = [None] * len(batch.reqs)
        if rows:
            assert logits is not None and logits.shape[0] == len(rows)
            reqs = [batch.reqs[i] for i in rows]
            sampled = self.sampler.sample(logits, [r.params for r in reqs], [self._generator(r) for r in reqs])
            for j, i in enumerate(rows):
                tokens[i], logprobs[i] = sampled.token_ids[j], sampled.logprobs[j]
        self.scheduler.commit(batch, tokens, logprobs)
        if self.connector is not None and batch.mode is ForwardMode.PREFILL:
            self.connector.after_commit(batch)
        for i in rows:
            req = batch.reqs[i]
            if req.finished:  # aborted while its forward ran (e.g. its transfer failed)
                continue
            token, logprob = tokens[i], logprobs[i]
            assert token is not None and logprob is not None  # each row in `rows` was sampled above
            num_new = 1 if req.params.max_new_tokens > 0 else 0
            fin = self.finisher.check(req, num_new)
            held = self._finish(req, *fin) if fin is not None else False
            out = TokenOutput(
                req.rid,
                (token,) if num_new else (),
                (logprob,) if num_new else (),
                req.finish_reason,
                req.finish_detail,
                len(req.input_ids),
                req.cached_tokens,
                timeline=_final_record(req),
            )
            if held and req.finish_reason is not FinishReason.ABORT:
                self._held[req.rid].deferred = out  # the client hears once the KV has landed
            else:
                outs.append(out)
        return outs

    # ---- speculative decoding ----------------------------------------------------------------
    def _propose(self, req: Req, max_drafts: int) -> list[int]:
        """NGRAM's, the draft model's or the MTP layer's drafts of a decode row (greedy rows keep the matching ones,
        sampled rows verify them by speculative sampling: spec_sampling.py)."""
        if self.draft is not None:
            return self.draft.propose(req.rid, req.all_ids, max_drafts)
        if self.mtp is not None:
            return self.mtp.propose(req, max_drafts)
        s = self.spec
        return propose_ngram(req.all_ids, max_drafts, s.ngram_min_match_window_size, s.ngram_max_match_window_size)

    def _commit_verify(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[TokenOutput]:
        """logits [sum(1 + drafts), V]: each row's target tokens after its last token and each
        draft; a greedy row keeps the longest matching prefix of its drafts and the bonus token,
        a sampled row what speculative sampling accepts and one drawn token."""
        counts = [1 + len(d) for d in batch.drafts]
        assert logits.shape[0] == sum(counts), (tuple(logits.shape), counts)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        # greedy rows (argmax at every position) and rows without drafts (one plain draw) go
        # through the sampler as any decode step; sampled rows with drafts are verified below
        plain = [
            (i, j)
            for i, (r, c) in enumerate(zip(batch.reqs, counts))
            if r.params.greedy or c == 1
            for j in range(starts[i], starts[i] + c)
        ]
        sel = torch.tensor([j for _, j in plain], dtype=torch.int64, device=logits.device)
        sampled = self.sampler.sample(
            logits[sel], [batch.reqs[i].params for i, _ in plain], [self._generator(batch.reqs[i]) for i, _ in plain]
        )
        by_row: dict[int, tuple[list[int], list[float]]] = {}
        for (i, _), t, lp in zip(plain, sampled.token_ids, sampled.logprobs):
            toks, lps = by_row.setdefault(i, ([], []))
            toks.append(t)
            lps.append(lp)
        outs: list[TokenOutput] = []
        for i, req in enumerate(batch.reqs):
            draft = batch.drafts[i]
            if req.finished:  # aborted while its forward ran
                continue
            if i in by_row:
                targets, lps = by_row[i]
                accepted = accepted_prefix(draft, targets)
            else:
                rows = logits[starts[i] : starts[i] + counts[i]]
                targets, accepted = self._speculative_sample(req, rows, draft)
                raw = torch.log_softmax(rows.float(), dim=-1)  # logprobs of the raw logits, as the sampler's
                lps = [float(raw[j, t]) for j, t in enumerate(targets)]
            fins: list[tuple[FinishReason, str | int | None]] = []
            n = self.scheduler.commit_verify(
                req, batch.prefix_lens[i], targets[: accepted + 1], lps[: accepted + 1], partial(self._stops, fins)
            )
            if self._rollback is not None:  # before _finish: its snapshots go to the cache there
                cache = self.prefix_cache if isinstance(self.prefix_cache, HybridRadixCache) else None
                self._rollback.verified(req, batch.prefix_lens[i], counts[i], n, cache, self.allocator, self.page_size)
            self.spec_counts.add(len(draft), accepted, n)
            if req.spec is None:
                req.spec = SpecCounts()
            req.spec.record(draft, accepted, n)
            held = self._finish(req, *fins[0]) if fins else False
            out = TokenOutput(
                req.rid,
                tuple(req.output_ids[-n:]),
                tuple(req.output_logprobs[-n:]),
                req.finish_reason,
                req.finish_detail,
                len(req.input_ids),
                req.cached_tokens,
                spec=replace(req.spec) if req.finished else None,
                timeline=_final_record(req),
            )
            if held and req.finish_reason is not FinishReason.ABORT:
                self._held[req.rid].deferred = out
            else:
                outs.append(out)
        return outs

    def _speculative_sample(self, req: Req, logits: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
        """A sampled row's drafts verified by speculative sampling -> (its accepted drafts and one
        drawn token, the drafts accepted)."""
        gen = self._generator(req)
        weights = self.sampler.distributions(logits, [req.params] * logits.shape[0])
        return speculative_sample(
            weights, draft, partial(self.sampler.uniform, gen), partial(self.sampler.draw, gen=gen)
        )

    def _stops(self, fins: list[tuple[FinishReason, str | int | None]], req: Req) -> bool:
        """commit_verify's check after each appended token: a finish goes into `fins`."""
        fin = self.finisher.check(req, 1)
        if fin is not None:
            fins.append(fin)
        return fin is not None

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Run the batch on every rank: prefills as the planned layer groups, the connector's
        workers moving KV from their layer-group hooks."""
        plan = ForwardPlan(self._layer_groups)
        draft_kv = self.draft if self._draft_prefill and batch.mode is ForwardMode.PREFILL else None
        if draft_kv is not None:  # before the connector starts the rooms with their page tables
            for req in batch.reqs:
                draft_kv.reserve_prompt(req)
        mtp_kv = self.mtp if self._mtp_prefill and batch.mode is ForwardMode.PREFILL else None
        if mtp_kv is not None:  # the MTP page tables (private copies made) before the rooms start
            for req, pre in zip(batch.reqs, batch.prefix_lens):
                if req.rid not in mtp_kv.seqs:
                    req.draft_pages = mtp_kv.begin(req, pre)
        if batch.mode is ForwardMode.PREFILL and self.connector is not None:
            plan = self.connector.plan_forward(batch)
        n = plan.layer_groups if batch.mode is ForwardMode.PREFILL else 1
        groups = (plan.layer_bounds or split_layers(self.model_config.num_layers, n)) if n > 1 else None
        assert groups is None or len(groups) == n, (groups, n)
        if self._rollback is not None:
            batch.state_commits = self._rollback.take()
        spec: ForwardSpec = batch.spec(self.page_size, groups, plan.meta)
        callback = None
        worker = self._worker
        if worker is not None:
            worker.before_forward(plan.meta)
            callback = lambda start, end, fb: self._after_layers(worker, plan.meta, batch, start, end, n)  # noqa: E731
        prefill = batch.mode is ForwardMode.PREFILL
        if prefill:
            for req, n_new in zip(batch.reqs, batch.extend_lens):
                req.timeline.mark(Phase.FORWARD_START, value=n_new)
        logits = self._tp.run(spec, callback) if self._tp is not None else self.runner.run(spec, callback)
        if self.mtp is not None:
            self.mtp.keep(batch, self.runner.take_hidden())
        if draft_kv is not None:  # the draft model's KV of the chunk, sent as the last layer group
            n_kv = self.runner.pool.num_layers
            send = (n_kv, n_kv + draft_kv.num_layers)
            draft_kv.prefill_forward(batch, after=(plan.meta, *send) if callback is not None else None)
            if callback is not None:
                callback(*send, None)
        if mtp_kv is not None:  # the MTP layer's KV of the chunk: the last layer group
            mtp_kv.prefill_forward(batch)
            for i, req in enumerate(batch.reqs):
                if batch.completes_prefill(i):  # h_{L-1} goes with the first token (AuxData.hidden)
                    req.draft_hidden = mtp_kv.pending_hidden(req.rid)
            if callback is not None:  # send layer num_layers (model layers: a hybrid pool has fewer KV layers)
                n_layers = self.model_config.num_layers
                callback(n_layers, n_layers + 1, None)
        if prefill:
            for req, n_new in zip(batch.reqs, batch.extend_lens):
                req.timeline.mark(Phase.FORWARD_END, value=n_new)
        if self.connector is not None and prefill:
            self.connector.after_forward(batch)
        return logits

    @staticmethod
    def _after_layers(
        worker: KVConnectorWorker, meta: object, batch: ScheduledBatch, start: int, end: int, groups: int
    ) -> None:
        worker.after_layers(meta, start, end)
        if groups > 1 and batch.mode is ForwardMode.PREFILL:  # layer-pipelined: this group's KV is on its way
            for req in batch.reqs:
                req.timeline.mark(Phase.LAYER_GROUP_DONE, value=end)

    def _mark_scheduled(self, batch: ScheduledBatch) -> None:
        """A prefill batch's requests that left the queue with it (their first chunk)."""
        for req in batch.reqs:
            if not req.timeline.has(Phase.SCHEDULED):
                req.timeline.mark(Phase.SCHEDULED)
                req.timeline.prefix_hit_tokens = req.num_shared_pages * self.page_size

    def _drain_inbox(self, outs: list[TokenOutput]) -> None:
        with self._lock:
            new, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        now = time.monotonic()
        for req in new:
            if not req.eos_token_ids:
                req.eos_token_ids = self.eos_token_ids
            if self.connector is not None and self.connector.admit(req) is Admission.REMOTE:
                self._remote.append((req, now + self.connector.reserve_deadline_s()))
                continue
            if not self.scheduler.add(req):  # can never run: finished with ABORT and a message
                logger.warning("request %s rejected: %s", req.rid, req.finish_detail)
                self._settle(req, self._connector_holds(req, FinishReason.ABORT, req.finish_detail))
                outs.append(self._finish_output(req))
        for rid in aborts:
            self._abort(rid, outs)

    def _abort(self, rid: str, outs: list[TokenOutput]) -> None:
        req = self.scheduler.get(rid) or next((r for r, _ in self._remote if r.rid == rid), None)
        if req is not None and not req.finished:
            self._finish(req, FinishReason.ABORT, ABORTED_ON_REQUEST)
            outs.append(self._finish_output(req))
            return
        h = self._held.get(rid)
        if h is not None and not h.replied:  # done here, its transfer still runs: stop it, answer now
            h.replied = True
            outs.append(self._abort_output(h.req, ABORTED_ON_REQUEST))
            assert self.connector is not None
            self.connector.abort_transfer(h.req, "client disconnected or request aborted")

    def _reserve_remote(self, outs: list[TokenOutput]) -> None:
        """Give REMOTE requests the pages of their prompt (FIFO, head of line) and let the
        connector ask for their KV; a request that finds no pages by its deadline fails."""
        assert self.connector is not None
        now = time.monotonic()
        while self._remote:
            req, deadline = self._remote[0]
            if req.finished:
                self._remote.popleft()
                continue
            if not self.scheduler.reserve(req):
                if not req.finished and now < deadline:
                    return  # no room now: retry next step
                self._remote.popleft()
                if req.finished:  # it can never fit: the scheduler finished it with a message
                    self._settle(req, self._connector_holds(req, FinishReason.ABORT, req.finish_detail))
                else:
                    self._finish(
                        req,
                        FinishReason.ABORT,
                        f"no free KV pages within the waiting timeout ({self.cfg.disaggregation.waiting_timeout_s}s)",
                    )
                outs.append(self._finish_output(req))
                continue
            self._remote.popleft()
            req.timeline.prefix_hit_tokens = req.num_shared_pages * self.page_size
            if self.draft is not None:  # the prompt's draft KV lands next to its KV
                self.draft.reserve_prompt(req)
            if self.mtp is not None:  # NEXTN: the prompt's MTP KV lands in its own pages (the MTP pool's ids)
                req.draft_pages = req.pages[: -(-len(req.input_ids) // self.page_size)].copy()
            try:
                self.connector.on_reserved(req)
            except ValueError as e:  # e.g. pages the transfer refuses: nothing was asked for
                self._finish(req, FinishReason.ABORT, str(e))
                outs.append(self._finish_output(req))
                continue
            req.timeline.mark(Phase.PAGES_RESERVED)

    def _poll_connector(self, outs: list[TokenOutput]) -> None:
        assert self.connector is not None
        for ev in self.connector.poll():
            if isinstance(ev, KVArrived):
                self._kv_arrived(ev, outs)
                continue
            assert isinstance(ev, TransferFinished)
            h = self._held.pop(ev.rid, None)
            if h is not None:  # pages are safe now
                self.scheduler.release(ev.rid)
                self._forget(ev.rid)
                h.req.timeline.mark(Phase.RELEASED)
                if not h.replied:
                    outs.append(
                        replace(h.deferred, timeline=h.req.timeline.record())
                        if ev.ok and h.deferred is not None
                        else self._abort_output(h.req, f"KV transfer failed: {ev.reason}")
                    )
                continue
            req = self.scheduler.get(ev.rid)
            if req is not None and not ev.ok:  # still computing or waiting for its KV: stop it
                self._finish(req, FinishReason.ABORT, f"KV transfer failed: {ev.reason}")
                outs.append(self._finish_output(req))

    def _kv_arrived(self, ev: KVArrived, outs: list[TokenOutput]) -> None:
        req = self.scheduler.get(ev.rid)
        if req is None or req.rid not in self.scheduler.reserved:
            logger.warning("KV arrived for %s, which is not waiting for it", ev.rid)
            return
        req.timeline.mark(Phase.KV_ARRIVED)
        req.timeline.mark(Phase.FIRST_TOKEN)
        req.output_ids.append(ev.first_token_id)
        req.output_logprobs.append(ev.first_token_logprob)
        if self.draft is not None:
            self.draft.kv_arrived(req, ev.draft_tokens)
        if self.mtp is not None:
            try:
                self.mtp.kv_arrived(req, ev.draft_tokens, ev.draft_hidden)
            except ValueError as e:  # a peer the handshake let through should never send this
                logger.warning("request %s: the prefill's NEXTN state refused (%s); its drafts start cold", req.rid, e)
        # cached_tokens means what it means colocated: prompt tokens not computed (by the prefill);
        # the decode's own prefix (req.num_shared_pages) shows in the KV bytes not transferred
        req.cached_tokens = ev.prefill_cached_tokens
        self.scheduler.add_prefilled(req)  # its prompt's KV is verified: it may go to the prefix cache
        fin = self.finisher.check(req, 1)
        if fin is not None:
            self._finish(req, *fin)
        outs.append(
            TokenOutput(
                req.rid,
                (ev.first_token_id,),
                (ev.first_token_logprob,),
                req.finish_reason,
                req.finish_detail,
                len(req.input_ids),
                req.cached_tokens,
                timeline=_final_record(req),
            )
        )

    def _connector_holds(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        return self.connector is not None and self.connector.on_finish(req, reason, detail)

    def _finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        """End `req`; True when a transfer keeps its pages (then they are freed at its
        TransferFinished, and a normal finish is answered then)."""
        hold = self._connector_holds(req, reason, detail)
        if self.mtp is not None and self.prefix_cache is not None and reason is not FinishReason.ABORT:
            self.mtp.finish(req)  # its full pages go to the radix cache with their MTP KV complete
        self.scheduler.finish(req, reason, detail, hold=hold)
        return self._settle(req, hold)

    def _settle(self, req: Req, hold: bool) -> bool:
        req.timeline.mark(Phase.FINISHED)
        if hold:  # its rid stays taken until the transfer lets go of its pages
            self._held[req.rid] = _Held(req, replied=req.finish_reason is FinishReason.ABORT)
        self._forget(req.rid, release_rid=not hold)
        return hold

    def _forget(self, rid: str, release_rid: bool = True) -> None:
        self._generators.pop(rid, None)
        # every end of a request passes here (finish, abort, failure); a transfer that holds the
        # request (release_rid False) may still read or write its draft pages: freed at its end
        if self.draft is not None and release_rid:
            self.draft.release(rid)
        if self.mtp is not None and release_rid:  # a PD prefill's transfer may still read its private pages
            self.mtp.release(rid)
        self.finisher.forget(rid)
        if release_rid:
            with self._lock:
                self._active.discard(rid)

    def _abort_output(self, req: Req, message: str) -> TokenOutput:
        """An ABORT answer for a request finished otherwise earlier (its answer was held back)."""
        return TokenOutput(
            req.rid,
            (),
            (),
            FinishReason.ABORT,
            message,
            len(req.input_ids),
            req.cached_tokens,
            timeline=req.timeline.record(),
        )

    def _finish_output(self, req: Req) -> TokenOutput:
        return TokenOutput(
            req.rid,
            (),
            (),
            req.finish_reason,
            req.finish_detail,
            len(req.input_ids),
            req.cached_tokens,
            timeline=req.timeline.record(),
        )

    def _generator(self, req: Req) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = self._generators.get(req.rid)
        if g is None:
            g = self._generators[req.rid] = make_generator(req.params.seed, self._device)
        return g

    @property
    def model(self) -> LMBase:
        """This process's model (rank 0's under TP): for benchmarks that switch a model-level path
        step by step (bench/engine/decode_profile.py --ab)."""
        return self.runner.model

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.connector is not None:
            self.connector.shutdown()
        if self._worker is not None:
            self._worker.close()
        if self._tp is not None:
            self._tp.shutdown()
        if self.store_tier is not None:
            self.store_tier.close()

    # ---- synchronous convenience -----------------------------------------------------------
    def generate(
        self,
        prompts_or_ids: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        timeout_s: float = 600.0,
    ) -> list[dict]:
        """Run prompts (text or token ids, one or a list) to completion; SGLang-shaped results."""
        prompts: list[str | Sequence[int]]
        if _one_prompt(prompts_or_ids):
            prompts = [prompts_or_ids]
        else:  # a list of prompts, each text or token ids
            prompts = list(cast("Sequence[str | Sequence[int]]", prompts_or_ids))
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        reqs = []
        for p, sp in zip(prompts, plist):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            reqs.append(Req(f"gen-{uuid.uuid4().hex}", ids, sp, self.eos_token_ids))
        t0 = time.monotonic()
        for r in reqs:
            self.add_request(r)
        while not all(r.finished for r in reqs):
            if time.monotonic() - t0 > timeout_s:
                for r in reqs:
                    self.abort(r.rid)
                self.step()
                raise TimeoutError(f"generate did not finish within {timeout_s}s")
            self.step()
        latency = time.monotonic() - t0
        return [self._result(r, latency) for r in reqs]

    def _result(self, req: Req, latency: float) -> dict:
        text = self.tokenizer.decode(req.output_ids)
        if req.finish_reason is FinishReason.STOP and isinstance(req.finish_detail, str):
            cut = text.find(req.finish_detail)
            text = text[:cut] if cut >= 0 else text
        reason = finish_reason_json(req.finish_reason, req.finish_detail, len(req.output_ids))
        return {
            "text": text,
            "output_ids": list(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "finish_reason": reason,
                "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
                "output_token_logprobs": list(req.output_logprobs),
                "e2e_latency": latency,
                **(req.spec.meta_info() if req.spec is not None else {}),
            },
        }


def check_speculative(cfg: ServerConfig, model: ModelConfig) -> None:
    """Refuse speculative decoding where it cannot run (yet): draft models and MTP layers the
    drafters cannot serve. Every target model rolls back a rejected draft: its KV pages and
    sliding-window pages (Scheduler.commit_verify), a hybrid model's recurrent state
    (engine/spec/state_rollback.py)."""
    if not cfg.speculative.enabled:
        return
    if cfg.speculative.standalone_draft_path is not None:  # before any TP rank starts
        check_draft_model(cfg, model, ModelConfig.from_dir(cfg.speculative.standalone_draft_path))
    if cfg.speculative.eagle_head_path is not None:
        check_eagle(cfg, model)
    elif cfg.speculative.uses_mtp:
        check_nextn(cfg, model)
