"""The engine: tokenizer, scheduler, model runner (or TP group), sampler, finish logic, a
speculative drafter, and an optional KV connector (kvpipe/engine/connector.py) through which PD
disaggregation plugs in.

One thread calls step() in a loop; add_request/abort may come from any thread and land in the
one lock-protected inbox (inbox.py) that step() drains first. `poll_interval()` tells the loop
when the next step has something to do (now, after a transfer poll interval, or only on new
input). Its parts, one file each: the connector's steps (connector_driver.py), the ends of
requests and the answers a transfer holds back (request_ends.py), a speculative step's commit
(spec/verify_step.py), the drafter of --speculative-algorithm (spec/registry.py), the prefix
cache's kind (prefix_cache_setup.py) and offline generation (offline.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.config import ParallelConfig, ServerConfig
from kvpipe.engine.batch import ForwardMode, ForwardSpec, ScheduledBatch
from kvpipe.engine.connector import ConnectorContext, EngineRole, ForwardPlan, KVConnector, KVConnectorWorker
from kvpipe.engine.connector_driver import ConnectorDriver
from kvpipe.engine.connector_workers import RankWorkers
from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.inbox import Inbox
from kvpipe.engine.model_runner import ModelRunner, snapshot_slots, split_layers, state_slots
from kvpipe.engine.offline import Prompts, generate
from kvpipe.engine.outputs import finish_output
from kvpipe.engine.prefix_cache_setup import make_prefix_cache, sliding_window
from kvpipe.engine.request import ABORTED_ON_REQUEST, FinishReason, Req, SamplingParams, TokenOutput
from kvpipe.engine.request_ends import RequestEnds
from kvpipe.engine.sampler import RequestGenerators, Sampler
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.spec.draft_model import DraftModel
from kvpipe.engine.spec.drafter import Drafter, LayerSend
from kvpipe.engine.spec.mtp_drafter import MTPDrafter
from kvpipe.engine.spec.registry import DrafterContext, DraftKV, drafter_entry
from kvpipe.engine.spec.state_rollback import StateRollback
from kvpipe.engine.spec.verify import SpecCounts
from kvpipe.engine.spec.verify_step import VerifyStep
from kvpipe.engine.step_log import SpecTotals, StepLog
from kvpipe.engine.store_setup import attach_store_tier
from kvpipe.engine.timeline import Phase
from kvpipe.engine.tp_group import TPGroup, build_runner
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_generation_eos
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TIER_POLL_S = 0.005  # how often an idle engine checks a KV-tier prefetch (cache/store_tier.py)


class Engine:
    def __init__(self, cfg: ServerConfig, connector: KVConnector | None = None, layer_groups: int = 1) -> None:
        """`layer_groups`: prefill forwards run as this many layer groups when no connector
        plans them (a colocated engine computes the same either way)."""
        self.cfg = cfg
        self.model_config = model_config_of(cfg.model_path)
        self.tokenizer = Tokenizer.from_dir(
            cfg.tokenizer_path or cfg.model_path, extra_eos_ids=load_generation_eos(cfg.model_path)
        )
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(self.tokenizer.eos_token_ids + self.model_config.eos_token_ids)
        )
        self.context_length: int = cfg.scheduler.context_length or self.model_config.max_position_embeddings
        self.spec = cfg.speculative
        self.page_size = cfg.cache.page_size
        self.connector = connector
        self.role = EngineRole.of(connector)  # what it does, as its connector says (never the mode)
        self._layer_groups = layer_groups
        self._wakeup: Callable[[], None] | None = None
        self._worker: KVConnectorWorker | None = None
        self._start_model(cfg)
        self.allocator = PageAllocator(cfg.cache.pages(), cfg.cache.debug_checks)
        self.prefix_cache = make_prefix_cache(cfg, self.model_config, self.role, self.runner.state_pool)
        hybrid = self.model_config.hybrid is not None
        self.state_slots = StateSlotAllocator(state_slots(cfg.cache, cfg.scheduler)) if hybrid else None
        # a hybrid model's verify steps: the accepted position's state, committed by the next forward
        self._rollback = StateRollback() if hybrid and self.spec.enabled else None
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.allocator,
            self.page_size,
            self.context_length,
            whole_prompt_pages=self.role.whole_prompt_pages,
            prefix_cache=self.prefix_cache,
            state_slots=self.state_slots,
            window=sliding_window(self.model_config),
            drafter=self.drafter.propose if self.drafter is not None else None,
            max_drafts=self.spec.max_drafts,
            # a MIXED step's decode rows go through the prefill forward: only where nothing else
            # hooks a forward (a KV connector, a drafter) or keeps per-row recurrent state
            mixed_chunk=cfg.scheduler.enable_mixed_chunk
            and connector is None
            and self.drafter is None
            and self.state_slots is None,
        )
        # the KV tier on a Mooncake Store (--enable-hierarchical-cache): the scheduler loads and stores pages
        self.store_tier = attach_store_tier(cfg, self.runner.pool, self.scheduler, tp=self._tp)
        self.sampler = Sampler(cfg.seed, self._device)
        self.generators = RequestGenerators(self._device)  # seeded requests' private RNG streams
        self.finisher = FinishChecker(self.tokenizer, self.eos_token_ids, self.context_length)
        self.inbox = Inbox()
        cache_drafts = self.prefix_cache is not None
        self.ends = RequestEnds(
            self.scheduler, self.finisher, self.generators, self.inbox, connector, self.drafter, cache_drafts
        )
        self.verifier = VerifyStep(self.sampler, self.generators, self.scheduler, self.finisher, self._rollback)
        self.step_log = StepLog(cfg.decode_log_interval)
        self.driver: ConnectorDriver | None = None
        if connector is not None:
            self._start_connector(connector)

    def _start_model(self, cfg: ServerConfig) -> None:
        """The target model on every TP rank, then its drafter (refused before any rank starts
        when it cannot serve next to this target)."""
        entry = drafter_entry(self.spec)
        if entry is not None:
            entry.check(cfg, self.model_config)
        if self.model_config.hybrid is not None:
            snapshot_slots(cfg, self.role)  # a --max-mamba-cache-size without room for snapshots: refused here
        self._tp: TPGroup | None = None
        if cfg.tp_size > 1:
            factory = self.connector.worker_factory if self.connector is not None else None
            sharded = entry is not None and entry.draft_kv is DraftKV.SHARDED
            self._tp = TPGroup(cfg, factory, self.role, sharded_draft=sharded)
            self.runner: ModelRunner = self._tp.runner
            self._device = self._tp.device
        else:
            self._device = cfg.device
            self.runner = build_runner(cfg, ParallelConfig(), self._device, self.role)
        ctx = DrafterContext(cfg, self.model_config, self.runner, self._device, self._tp)
        self.drafter: Drafter | None = entry.build(ctx) if entry is not None else None
        if self.drafter is not None and self.drafter.uses_target_hidden:
            self.runner.capture_hidden = True
        # a PD prefill's drafter runs over each prompt chunk; its KV goes to the decode with the target's
        moves = self.drafter is not None and self.drafter.moves_kv and self.role.drafts_on_prefill
        self._prefill_drafter = self.drafter if moves else None

    def _start_connector(self, connector: KVConnector) -> None:
        """Rank 0's connector worker, the connector's start (every rank's worker reachable)."""
        try:
            self._worker = connector.make_worker(
                self.runner.pool, self.model_config.kv_cache_heads, self.runner.state_pool
            )
            draft_pool, draft_kv_heads = self.drafter.moving_pool() if self.drafter is not None else (None, None)
            connector.start(
                ConnectorContext(
                    self.cfg,
                    self.model_config,
                    RankWorkers(self._worker, self._tp),
                    self._wake,
                    draft_pool=draft_pool,
                    draft_kv_heads=draft_kv_heads,
                )
            )
            wait_s = self.cfg.disaggregation.waiting_timeout_s
            self.driver = ConnectorDriver(connector, self.scheduler, self.ends, self.finisher, self.drafter, wait_s)
        except BaseException:
            self.shutdown()
            raise

    # ---- what tests and benchmarks read of the drafter --------------------------------------
    @property
    def draft(self) -> DraftModel | None:
        """The STANDALONE draft model, if that is the drafter."""
        return self.drafter if isinstance(self.drafter, DraftModel) else None

    @property
    def mtp(self) -> MTPDrafter | None:
        """The NEXTN (or EAGLE) drafter, if that is the drafter."""
        return self.drafter if isinstance(self.drafter, MTPDrafter) else None

    @property
    def spec_counts(self) -> SpecCounts:
        """The server's verify steps, drafts proposed and accepted."""
        return self.verifier.counts

    # ---- thread-safe entry points ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request (any thread). ValueError: its rid is still active, or the connector
        refuses it (e.g. PD bootstrap fields missing or in use)."""
        req.timeline.enabled = self.cfg.request_metrics  # --disable-request-metrics: nothing recorded
        req.timeline.mark(Phase.ARRIVED)
        self.inbox.add(req, self.connector.claim if self.connector is not None else None)

    def abort(self, rid: str) -> None:
        """Finish a request with ABORT at the next step (any thread); unknown rids are ignored."""
        self.inbox.abort(rid)

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
        if self.inbox.pending():
            return 0.0
        s = self.scheduler
        remote = self.driver.num_waiting if self.driver is not None else 0
        if s.running or (s.waiting and not self.ends.held and not s.reserved and not remote):
            # requests waiting only for the KV tier's prefetch: look again shortly, do not spin
            return TIER_POLL_S if not s.running and s.waiting_on_tier() else 0.0
        hint = self.driver.wait_hint() if self.driver is not None else None
        if s.waiting_on_tier():
            hint = TIER_POLL_S if hint is None else min(hint, TIER_POLL_S)
        return hint

    def has_work(self) -> bool:
        return self.poll_interval() is not None

    def stats(self) -> dict:
        s: dict[str, Any] = dict(self.scheduler.stats())
        s["num_waiting"] += self.inbox.num_new()
        s["num_waiting"] += self.driver.num_waiting if self.driver is not None else 0
        s.update(context_length=self.context_length, tp_size=self.cfg.tp_size, kv_cache_bytes=self.runner.pool.nbytes)
        s["generated_tokens"] = self.step_log.generated
        s["kv_cache_storage_dtype"] = str(self.runner.pool.dtype).removeprefix("torch.")  # --kv-cache-dtype resolved
        if self.spec.enabled:
            c = self.spec_counts
            s.update(spec_verify_steps=c.verify_ct, spec_proposed_tokens=c.proposed, spec_accepted_tokens=c.accepted)
            s["avg_spec_accept_length"] = round(c.accept_length, 4)  # SGLang's name: tokens per verify step
        if self.connector is not None:
            s.update(self.connector.stats())
        if self.store_tier is not None:
            s["kv_store"] = self.store_tier.stats()
        return s

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one scheduler step; returns the news of every request it touched ([] when idle)."""
        outs = self._drain_inbox()
        if self.driver is not None and self.driver.step(outs):
            return outs  # a first token that arrived with its KV goes out now, not after the next forward
        batch = self.scheduler.schedule()
        if batch is None:
            return outs
        started, before = time.monotonic(), sum(len(r.output_ids) for r in batch.reqs)
        logits = self._run(batch)
        outs += self._verify(batch, logits) if batch.drafts else self._sample(batch, logits)
        generated = sum(len(r.output_ids) for r in batch.reqs) - before
        spec = SpecTotals(self.spec_counts.verify_ct, self.spec_counts.emitted) if self.spec.enabled else None
        line = self.step_log.after_step(batch, generated, time.monotonic() - started, self.stats, spec)
        if line is not None:
            logger.info(line)
        return outs

    def _drain_inbox(self) -> list[TokenOutput]:
        """New requests to the scheduler (or, REMOTE, to the connector's wait for pages), aborts done."""
        outs: list[TokenOutput] = []
        new, aborts = self.inbox.take()
        now = time.monotonic()
        for req in new:
            if not req.eos_token_ids:
                req.eos_token_ids = self.eos_token_ids
            if self.driver is not None and self.driver.admit(req, now):
                continue
            if not self.scheduler.add(req):  # can never run: finished with ABORT and a message
                logger.warning("request %s rejected: %s", req.rid, req.finish_detail)
                self.ends.settle(req, self.ends.connector_holds(req, FinishReason.ABORT, req.finish_detail))
                outs.append(finish_output(req))
        for rid in aborts:
            self._abort(rid, outs)
        return outs

    def _abort(self, rid: str, outs: list[TokenOutput]) -> None:
        req = self.scheduler.get(rid) or (self.driver.waiting(rid) if self.driver is not None else None)
        if req is not None and not req.finished:
            self.ends.finish(req, FinishReason.ABORT, ABORTED_ON_REQUEST)
            outs.append(finish_output(req))
            return
        out = self.driver.abort_held(rid) if self.driver is not None else None
        if out is not None:  # done here, its transfer still runs: stopped, answered now
            outs.append(out)

    def _run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The batch's forward; a failure leaves no half-run request behind: its pages go back (or
        to its transfer), and the caller sees the error."""
        if batch.mode is not ForwardMode.DECODE:
            self._mark_scheduled(batch)
        try:
            return self._forward(batch)
        except Exception as e:
            for req in batch.reqs:
                self.ends.finish(req, FinishReason.ABORT, f"forward failed: {e}")
            raise

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> list[TokenOutput]:
        """A prefill or plain decode step: rows that completed their prompt (or decode) sample a
        token; every row's KV is committed."""
        rows = [i for i, r in enumerate(batch.reqs) if batch.completes_prefill(i)]
        for i in rows:
            batch.reqs[i].timeline.mark(Phase.FIRST_TOKEN)
        tokens: list[int | None] = [None] * len(batch.reqs)
        logprobs: list[float | None] = [None] * len(batch.reqs)
        if rows:
            assert logits is not None and logits.shape[0] == len(rows)
            reqs = [batch.reqs[i] for i in rows]
            sampled = self.sampler.sample(logits, [r.params for r in reqs], [self.generators.get(r) for r in reqs])
            for j, i in enumerate(rows):
                tokens[i], logprobs[i] = sampled.token_ids[j], sampled.logprobs[j]
        self.scheduler.commit(batch, tokens, logprobs)
        if self.connector is not None and batch.mode is ForwardMode.PREFILL:
            self.connector.after_commit(batch)
        outs = []
        for i in rows:
            req = batch.reqs[i]
            if req.finished:  # aborted while its forward ran (e.g. its transfer failed)
                continue
            num_new = 1 if req.params.max_new_tokens > 0 else 0
            out = self.ends.answer(req, self.finisher.check(req, num_new), num_new)
            if out is not None:
                outs.append(out)
        return outs

    def _verify(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> list[TokenOutput]:
        """A speculative decode step: every row verifies its drafts (maybe none)."""
        assert logits is not None
        outs = []
        for req, num_new, fin in self.verifier.commit(batch, logits):
            out = self.ends.answer(req, fin, num_new, with_spec=True)
            if out is not None:
                outs.append(out)
        return outs

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Run the batch on every rank: prefills as the planned layer groups, the connector's
        workers moving KV from their layer-group hooks."""
        prefill = batch.mode is ForwardMode.PREFILL
        drafter = self._prefill_drafter if prefill else None
        if drafter is not None:  # before the connector starts the rooms with their page tables
            drafter.before_prefill(batch)
        plan = ForwardPlan(self._layer_groups)
        if prefill and self.connector is not None:
            plan = self.connector.plan_forward(batch)
        n = plan.layer_groups if prefill else 1
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
        chunks = [(r, n) for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)) if batch.is_prompt_row(i)]
        for req, n_new in chunks:
            req.timeline.mark(Phase.FORWARD_START, value=n_new)
        logits = self._tp.run(spec, callback) if self._tp is not None else self.runner.run(spec, callback)
        if self.drafter is not None and self.drafter.uses_target_hidden:
            self.drafter.after_forward(batch, self.runner.take_hidden())
        if drafter is not None:  # the draft KV of the chunk, sent as the last layer group
            send = None if callback is None else LayerSend(plan.meta, lambda start, end: callback(start, end, None))
            drafter.prefill_forward(batch, send)
        for req, n_new in chunks:
            req.timeline.mark(Phase.FORWARD_END, value=n_new)
        if prefill:
            if self.connector is not None:
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

    @property
    def model(self) -> LMBase:
        """This process's model (rank 0's under TP): for benchmarks that switch a model-level path
        step by step (bench/engine/decode_profile.py --ab)."""
        return self.runner.model

    def shutdown(self) -> None:
        if not self.inbox.close():
            return  # shut down already
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
        prompts_or_ids: Prompts,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        timeout_s: float = 600.0,
    ) -> list[dict]:
        """Run prompts (text or token ids, one or a list) to completion; SGLang-shaped results
        (offline.py)."""
        return generate(self, prompts_or_ids, params, timeout_s)
