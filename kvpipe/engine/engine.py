"""The colocated engine: tokenizer, scheduler, model runner (or TP group), sampler, finish logic.

One thread calls step() in a loop; add_request/abort may come from any thread and land in a
lock-protected inbox that step() drains first.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.config import ModelConfig, ParallelConfig, ServerConfig
from kvpipe.engine.batch import ForwardMode, ForwardSpec, ScheduledBatch
from kvpipe.engine.finish import FinishChecker
from kvpipe.engine.model_runner import GroupCallback, ModelRunner, split_layers
from kvpipe.engine.request import FinishReason, Req, SamplingParams, TokenOutput
from kvpipe.engine.sampler import Sampler, make_generator
from kvpipe.engine.scheduler import Scheduler, SchedulerHooks
from kvpipe.engine.tp_worker import TPGroup, build_runner
from kvpipe.model.loader import load_generation_eos
from kvpipe.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# (batch) -> layer groups its prefill forward runs as (1: one pass); called right before the forward
PrefillGroupsFn = Callable[[ScheduledBatch], int]
# (batch, start, end): layers [start, end) of the batch's prefill forward have written their KV
BatchGroupCallback = Callable[[ScheduledBatch, int, int], None]


class Engine:
    def __init__(self, cfg: ServerConfig, hooks: SchedulerHooks = SchedulerHooks(),
                 hold_finished_pages: bool = False, prefill_layer_groups: int | PrefillGroupsFn = 1,
                 on_group_done: BatchGroupCallback | None = None) -> None:
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model_path)
        self.tokenizer = Tokenizer.from_dir(cfg.tokenizer_path or cfg.model_path,
                                            extra_eos_ids=load_generation_eos(cfg.model_path))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            self.tokenizer.eos_token_ids + self.model_config.eos_token_ids))
        self.context_length: int = cfg.scheduler.context_length or self.model_config.max_position_embeddings
        self.page_size = cfg.cache.page_size
        # Seams for layer-pipelined KV transfer: a prefill forward runs as `prefill_layer_groups`
        # groups (a count, or a function of the batch called right before its forward), and
        # `on_group_done(batch, start, end)` runs after each group of a prefill forward (on rank 0
        # with TP: each layer ends in an all-reduce, so every rank wrote the group's KV by then).
        self.prefill_layer_groups = prefill_layer_groups
        self.on_group_done = on_group_done
        self._tp: TPGroup | None = None
        if cfg.tp_size > 1:
            self._tp = TPGroup(cfg)
            self.runner: ModelRunner = self._tp.runner
            device = self._tp.device
        else:
            device = cfg.device
            self.runner = build_runner(cfg, ParallelConfig(), device)
        self.allocator = PageAllocator(cfg.cache.pages(), cfg.cache.debug_checks)
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, self.page_size, self.context_length,
                                   hooks, hold_finished_pages)
        self.sampler = Sampler(cfg.seed, device)
        self.finisher = FinishChecker(self.tokenizer, self.eos_token_ids, self.context_length)
        self._device = device
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' private RNG streams
        self._lock = threading.Lock()
        self._inbox: list[Req] = []
        self._aborts: list[str] = []
        self._active: set[str] = set()  # rids added and not yet finished (duplicate check)
        self._closed = False

    @property
    def tp_group(self) -> TPGroup | None:
        """Rank 0's handle on the TP children (None with tp_size 1)."""
        return self._tp

    # ---- thread-safe entry points ----------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request (any thread). Raises ValueError for a rid that is still active."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            if req.rid in self._active or req.rid in self.scheduler.held:
                raise ValueError(f"a request with rid {req.rid!r} is already running")
            self._active.add(req.rid)
            self._inbox.append(req)

    def abort(self, rid: str) -> None:
        """Finish a request with ABORT at the next step (any thread); unknown rids are ignored."""
        with self._lock:
            self._aborts.append(rid)

    def has_work(self) -> bool:
        with self._lock:
            if self._inbox or self._aborts:
                return True
        return self.scheduler.has_work()

    def stats(self) -> dict:
        s = dict(self.scheduler.stats())
        with self._lock:
            s["num_waiting"] += len(self._inbox)
        s.update(context_length=self.context_length, tp_size=self.cfg.tp_size,
                 kv_cache_bytes=self.runner.pool.nbytes)
        return s

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one scheduler step; returns the news of every request it touched ([] when idle)."""
        outs: list[TokenOutput] = []
        self._drain_inbox(outs)
        batch = self.scheduler.schedule()
        if batch is None:
            return outs
        try:
            spec, callback = self._forward_spec(batch)
            logits = self._tp.run(spec, callback) if self._tp is not None else self.runner.run(spec, callback)
        except Exception as e:
            # leave no half-run request behind: its pages go back, the caller sees the error
            for req in batch.reqs:
                self._finish(req, FinishReason.ABORT, f"forward failed: {e}")
            raise
        rows = [i for i, w in enumerate(spec.want_logits) if w]
        tokens: list[int | None] = [None] * len(batch.reqs)
        logprobs: list[float | None] = [None] * len(batch.reqs)
        if rows:
            assert logits is not None and logits.shape[0] == len(rows)
            reqs = [batch.reqs[i] for i in rows]
            out = self.sampler.sample(logits, [r.params for r in reqs], [self._generator(r) for r in reqs])
            for j, i in enumerate(rows):
                tokens[i], logprobs[i] = out.token_ids[j], out.logprobs[j]
        self.scheduler.commit(batch, tokens, logprobs)
        for i in rows:
            req = batch.reqs[i]
            if req.finished:  # a hook may have ended it
                self._forget(req.rid)
                continue
            num_new = 1 if req.params.max_new_tokens > 0 else 0
            fin = self.finisher.check(req, num_new)
            if fin is not None:
                self._finish(req, *fin)
            outs.append(TokenOutput(
                req.rid, (tokens[i],) if num_new else (), (logprobs[i],) if num_new else (),
                req.finish_reason, req.finish_detail, len(req.input_ids), 0))
        return outs

    def _forward_spec(self, batch: ScheduledBatch) -> tuple[ForwardSpec, GroupCallback | None]:
        """The batch's ForwardSpec (layer groups chosen for a prefill) and its per-group callback."""
        if batch.mode is not ForwardMode.PREFILL:
            return batch.spec(self.page_size), None
        n = self.prefill_layer_groups
        n = n if isinstance(n, int) else n(batch)
        groups = split_layers(self.model_config.num_layers, n) if n > 1 else None
        callback = None
        if self.on_group_done is not None:
            on_group = self.on_group_done
            callback = lambda start, end, fb: on_group(batch, start, end)  # noqa: E731
        return batch.spec(self.page_size, groups), callback

    def _drain_inbox(self, outs: list[TokenOutput]) -> None:
        with self._lock:
            new, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        for req in new:
            if not req.eos_token_ids:
                req.eos_token_ids = self.eos_token_ids
            try:
                accepted = self.scheduler.add(req)
            except ValueError as e:  # its rid is taken (e.g. by a finished request holding pages)
                self._forget(req.rid)
                outs.append(TokenOutput(req.rid, (), (), FinishReason.ABORT, str(e), len(req.input_ids), 0))
                continue
            if not accepted:  # can never run: finished with ABORT and a message
                logger.warning("request %s rejected: %s", req.rid, req.finish_detail)
                outs.append(self._finish_output(req))
        for rid in aborts:
            req = self.scheduler.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ABORT, "aborted")
                outs.append(self._finish_output(req))

    def _finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> None:
        self.scheduler.finish(req, reason, detail)
        self._forget(req.rid)

    def _forget(self, rid: str) -> None:
        self._generators.pop(rid, None)
        self.finisher.forget(rid)
        with self._lock:
            self._active.discard(rid)

    def _finish_output(self, req: Req) -> TokenOutput:
        self._forget(req.rid)
        return TokenOutput(req.rid, (), (), req.finish_reason, req.finish_detail, len(req.input_ids), 0)

    def _generator(self, req: Req) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = self._generators.get(req.rid)
        if g is None:
            g = self._generators[req.rid] = make_generator(req.params.seed, self._device)
        return g

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._tp is not None:
            self._tp.shutdown()

    # ---- synchronous convenience -----------------------------------------------------------
    def generate(self, prompts_or_ids: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 timeout_s: float = 600.0) -> list[dict]:
        """Run prompts (text or token ids, one or a list) to completion; SGLang-shaped results."""
        if isinstance(prompts_or_ids, str) or (prompts_or_ids and isinstance(prompts_or_ids[0], int)):
            prompts_or_ids = [prompts_or_ids]  # type: ignore[list-item]
        prompts = list(prompts_or_ids)
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
        from kvpipe.engine.request import finish_reason_json

        text = self.tokenizer.decode(req.output_ids)
        if req.finish_reason is FinishReason.STOP and isinstance(req.finish_detail, str):
            cut = text.find(req.finish_detail)
            text = text[:cut] if cut >= 0 else text
        reason = finish_reason_json(req.finish_reason, req.finish_detail, len(req.output_ids))
        return {"text": text, "output_ids": list(req.output_ids),
                "meta_info": {"id": req.rid, "finish_reason": reason, "prompt_tokens": len(req.input_ids),
                              "completion_tokens": len(req.output_ids), "cached_tokens": 0,
                              "output_token_logprobs": list(req.output_logprobs), "e2e_latency": latency}}
