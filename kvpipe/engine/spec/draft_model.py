"""The STANDALONE drafter (SGLang's --speculative-algorithm STANDALONE): a smaller model with the
target's tokenizer proposes a chain of greedy drafts from its own paged KV.

Loaded by the target's loader into its own ModelRunner (its own KV pool, as many pages as the
target's, the same page size) and its own PageAllocator; draft_book.py keeps which tokens its KV
holds per request. One proposal: an extend forward over the request's tokens the draft KV lacks
(the whole prompt at the first decode step, later the accepted drafts and the bonus token), whose
last logits give draft 1, then single-token forwards of each draft for the next. The draft is a
point mass (argmax), so sampled requests verify it as NGRAM's (engine/spec/sampling.py).

PD (disagg/draft_transfer.py): a prefill reserves draft pages for a request's whole prompt at its
first forward and runs the draft over each prompt chunk after the target (`prefill_forward`); its
KV goes to the decode with the target's. The decode reserves the prompt's draft pages with the
target's (`reserve_prompt`) and takes what landed as written (`kv_arrived`).

TP (--tp-size > 1): the draft model is sharded like the target, over the same TP group (SGLang
runs the draft worker with the target's TP): every rank loads its shard of heads and MLP
(tp_group.build_draft_runner) with its own draft KV pool of the same page ids, rank 0 alone keeps
the book and sends each draft forward to every rank (TPGroup.run_draft), so all ranks write the
draft KV of the same tokens and rank 0 picks each draft from the all-reduced logits.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.config import ConfigError, ParallelConfig, ServerConfig
from kvpipe.engine.batch import ForwardSpec, ScheduledBatch
from kvpipe.engine.model_runner import state_slots
from kvpipe.engine.request import Req
from kvpipe.engine.spec.draft_book import DraftBook
from kvpipe.engine.spec.draft_state import DraftStates
from kvpipe.engine.spec.drafter import Drafter, LayerSend
from kvpipe.engine.tp_group import TPGroup, build_draft_runner
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.families.causal_lm import check_parallel


def check_draft_model(cfg: ServerConfig, target: ModelConfig, draft: ModelConfig) -> None:
    """Refuse a draft model the STANDALONE drafter cannot serve next to `target`."""
    path = cfg.speculative.draft_model_path
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"--speculative-draft-model-path {path}: its vocabulary ({draft.vocab_size} tokens) is not the "
            f"target's ({target.vocab_size}); a draft model must share the target's tokenizer"
        )
    if draft.sliding_layers:
        raise ConfigError(f"--speculative-draft-model-path {path}: a sliding-window draft model is not supported yet")
    if cfg.tp_size > 1 and (draft.hybrid is not None or target.hybrid is not None):
        # a hybrid draft's recurrent-state slots live on rank 0 only, and with a hybrid target the
        # draft KV does not move in PD (moves_kv) while TP children would register their shards
        raise ConfigError(
            f"--speculative-algorithm STANDALONE with --tp-size {cfg.tp_size} and a hybrid target or draft "
            "model: not supported yet (hybrid speculation runs with TP 1)"
        )
    if cfg.tp_size > 1:  # sharded like the target (the same TP group): its heads must split too
        try:
            check_parallel(draft, ParallelConfig(cfg.tp_size))
        except ConfigError as e:
            raise ConfigError(f"--speculative-draft-model-path {path} with --tp-size {cfg.tp_size}: {e}") from None


class DraftModel(Drafter):
    def __init__(
        self, cfg: ServerConfig, target: ModelConfig, device: str, tp: TPGroup | None, target_kv_layers: int
    ) -> None:
        """`tp`: the target's TP group (--tp-size > 1): every rank holds a shard of the draft model
        and runs each draft forward with rank 0 (TPGroup.run_draft), which alone keeps the book.
        `target_kv_layers`: the target pool's KV layers (PD sends the draft's after them)."""
        path = cfg.speculative.draft_model_path
        assert path is not None
        self.model_config = model_config_of(path)
        check_draft_model(cfg, target, self.model_config)
        self._tp = tp
        # a hybrid draft (TP 1): two recurrent-state slots per running request (draft_state.py)
        running = state_slots(cfg.cache, cfg.scheduler)
        hybrid = self.model_config.hybrid is not None
        # the draft's own KV in its compute dtype, its heads split like the target's
        self.runner = build_draft_runner(cfg, ParallelConfig(cfg.tp_size, 0), device, running if hybrid else 0)
        self.page_size = cfg.cache.page_size
        self.book = DraftBook(PageAllocator(cfg.cache.pages(), cfg.cache.debug_checks), cfg.cache.page_size)
        self.states = DraftStates(running) if hybrid else None
        # PD moves draft KV for a dense draft next to a dense target only (the sender moves draft KV
        # without recurrent state, and a hybrid draft's own state does not move): otherwise the
        # decode's draft catches up on the prompt at its first step, as a colocated engine's does
        self.moves_kv = not hybrid and target.hybrid is None
        self.send_from = target_kv_layers

    def _run(self, spec: ForwardSpec | None, after: tuple[object, int, int] | None = None) -> torch.Tensor | None:
        """A draft forward on every rank (rank 0's logits); `after`: the children's connector
        workers then ship those send layers (a PD prefill's draft KV)."""
        if self._tp is not None:
            return self._tp.run_draft(self.runner, spec, after)
        return None if spec is None else self.runner.run(spec)

    @torch.inference_mode()
    def propose(self, req: Req, max_drafts: int) -> list[int]:
        """Up to `max_drafts` greedy drafts after the request's prompt and outputs; [] when the
        draft pool has no room this step."""
        rid, tokens, num_drafts = req.rid, req.all_ids, max_drafts
        slots = None
        if self.states is not None:  # a hybrid draft catches up from its base state (draft_state.py)
            slots = self.states.get(rid)
            if slots is None:
                return []
        plan = self.book.plan(rid, tokens, num_drafts, max_start=None if slots is None else slots.base_len)
        if plan is None:
            return []
        drafts = [self._forward(plan.catch_up, plan.start, plan.pages, None if slots is None else slots.base)]
        self.book.wrote(rid, plan.catch_up)
        pos = plan.start + len(plan.catch_up)
        work = None
        if slots is not None:
            slots.base_len = pos
            if num_drafts > 1:  # the chain advances a copy: its drafts may be rejected
                assert self.runner.state_pool is not None
                self.runner.state_pool.copy_slots([slots.base], [slots.work])
                work = slots.work
        while len(drafts) < num_drafts:
            drafts.append(self._forward([drafts[-1]], pos, plan.pages, work))
            self.book.wrote(rid, drafts[-2:-1])
            pos += 1
        return drafts

    def _forward(self, token_ids: list[int], prefix_len: int, pages: np.ndarray, slot: int | None = None) -> int:
        """One row's forward of `token_ids` at positions prefix_len..; the argmax after the last.
        `slot`: a hybrid draft's recurrent-state slot."""
        used = -(-(prefix_len + len(token_ids)) // self.page_size)
        spec = ForwardSpec(
            (token_ids,),
            (prefix_len,),
            (np.ascontiguousarray(pages[:used]),),
            (True,),
            state_slots=None if slot is None else (slot,),
        )
        logits = self._run(spec)
        assert logits is not None
        return int(torch.argmax(logits[0]).item())

    @property
    def num_layers(self) -> int:
        """KV layers of the draft pool (PD sends them after the target's)."""
        return self.runner.pool.num_layers

    def reserve_prompt(self, req: Req) -> None:
        """PD: draft pages for `req`'s whole prompt, once (req.draft_pages; it stays empty when the
        draft pool has no room: the prompt's draft KV is then neither sent nor received, and the
        decode's first step catches up on the prompt). A hybrid draft's state does not move in PD
        (draft_state.py): no pages, and the decode catches up on the prompt."""
        if req.rid not in self.book.seqs and self.moves_kv:
            pages = self.book.reserve(req.rid, -(-len(req.input_ids) // self.page_size))
            req.draft_pages = pages.copy()

    def moving_pool(self) -> tuple[KVPool | None, int | None]:
        return (self.runner.pool if self.moves_kv else None), self.model_config.kv_cache_heads

    def before_prefill(self, batch: ScheduledBatch) -> None:
        for req in batch.reqs:
            self.reserve_prompt(req)

    def on_reserved(self, req: Req) -> None:
        self.reserve_prompt(req)  # the prompt's draft KV lands next to its KV

    def prefill_forward(self, batch: ScheduledBatch, send: LayerSend | None) -> None:
        """The chunk's draft KV, sent as the last layer group: send layers after the target's."""
        layers = (self.send_from, self.send_from + self.num_layers)
        self._prefill_forward(batch, after=(send.meta, *layers) if send is not None else None)
        if send is not None:
            send.send(*layers)

    @torch.inference_mode()
    def _prefill_forward(self, batch: ScheduledBatch, after: tuple[object, int, int] | None) -> None:
        """PD prefill: the draft's KV of each row's prompt up to the end of this chunk, in one
        extend forward (from the draft KV's end: a prefix the target took from its cache is computed
        here too). Rows without draft pages are left out. `after` (connector meta, send layers):
        what the TP children's connector workers ship once their shard ran (rank 0's caller ships
        its own)."""
        rows, starts, tables, ids = [], [], [], []
        for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            seq = self.book.seqs.get(req.rid)
            end = pre + n
            if seq is None or not req.draft_pages.size or len(seq.tokens) >= end:
                continue
            start = len(seq.tokens)  # a prefill records prompt tokens only, in order
            rows.append(req)
            starts.append(start)
            ids.append([int(t) for t in req.input_ids[start:end]])
            tables.append(np.ascontiguousarray(seq.pages[: -(-end // self.page_size)]))
        if not rows:
            if self._tp is not None and after is not None:
                self._tp.run_draft(self.runner, None, after)
            return
        spec = ForwardSpec(tuple(ids), tuple(starts), tuple(tables), (False,) * len(rows))
        self._run(spec, after)
        for req, toks in zip(rows, ids):
            self.book.wrote(req.rid, toks)

    def kv_arrived(self, req: Req, num_tokens: int, hidden: bytes = b"") -> None:
        """PD decode: the prefill wrote the draft KV of the prompt's first `num_tokens` tokens into
        req.draft_pages (its aux data says so): the draft book holds them now."""
        n = min(num_tokens, len(req.input_ids), req.draft_pages.size * self.page_size)
        seq = self.book.seqs.get(req.rid)
        if n > 0 and seq is not None and not seq.tokens:
            self.book.wrote(req.rid, req.input_ids[:n])

    def release(self, rid: str) -> None:
        self.book.release(rid)
        if self.states is not None:
            self.states.release(rid)
