"""The NEXTN drafter (SGLang's --speculative-algorithm NEXTN, and EAGLE without a draft model
path): the checkpoint's multi-token-prediction layer (DeepSeek-V3's, model/draft/mtp.py; Qwen3.5's,
model/draft/qwen3_5_mtp.py) proposes a chain of greedy drafts from the target's last hidden states.

Positions. The MTP at position i takes the target's hidden state h_i (after its final norm) and
the token t_{i+1} that followed, writes its KV at i and guesses t_{i+2}. A decode row whose tokens
are t_0 .. t_{n-1} (t_{n-1} sampled, not yet in the target's KV) needs the MTP KV of positions
0 .. n-2: its last row (h_{n-2}, t_{n-1}) gives draft 1, and draft j + 1 comes from the chain
step (out_j, d_j) at position n - 2 + j, out_j being the MTP's own output hidden state.

Where its KV lives. The MTP's one-layer pool (DeepSeek's latent, Qwen3.5's K/V) has the target
pool's page ids (plus a few scratch pages): position i of a request is on the same page as its
target KV, so what the radix cache shares for a prefix holds the MTP KV of that prefix too, and
freeing the target's pages
frees the MTP's (aborts included). The chain's positions n - 1 .. lie past the request's valid
KV: in its own partly filled last page, then in the scratch pages; the catch-up of the next step
overwrites them. Only full pages go to the radix cache: before a request finishes the drafter
catches its MTP KV up on those (finish()), so a cached prefix holds the MTP KV of every position.
The MTP KV row of position i depends on t_{i+1} (its own input only: a layer's K/V at a position
never depends on other positions). So the last row of a cached page was computed with the token
that followed it in the request that computed it; where the radix tree branches right after that
page, another branch's request would read it stale (SGLang keys its EAGLE radix cache by token
pairs for this). The drafter keeps, for the last position of every page it computed, the target's
hidden state there and the token that followed (`page_hidden`, `page_next`); a request starting
behind a cached prefix checks each of its shared pages, and where the following token differs
it gets a private copy of that page (copy on write: other requests read the shared one) with the
row recomputed for its own token. With no private page free the row stays as cached: drafts may
differ, outputs never (every draft is verified).

Which MTP KV is valid. The target's hidden states arrive with every forward (after_forward(), rows kept
per request from its first uncomputed MTP position); propose() first catches the MTP KV up on
positions valid .. n-2 (one extend forward), then runs the chain. A rejected draft leaves the
target's KV at n - 1 + accepted positions; the next forward at that prefix overwrites the
hidden rows past it, and the catch-up starts where the MTP's valid KV ended (rollback is nothing
but that: positions past the valid prefix are recomputed before they are read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import Req
from kvpipe.engine.spec.drafter import Drafter, LayerSend
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.draft.mtp import load_mtp
from kvpipe.model.draft.mtp_layer import MTPLayer
from kvpipe.model.families.causal_lm import LMBase
from kvpipe.model.forward_batch import ForwardBatch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_nextn(cfg: ServerConfig, model: ModelConfig) -> None:
    """Refuse NEXTN where it cannot run (yet): no MTP layer. With --tp-size > 1 the MTP layer runs
    whole on rank 0 (the target's last hidden states, its embedding and lm_head are replicated on
    every rank; the MLA latent is TP-invariant), not sharded over the TP group; in PD its KV moves
    from prefill rank 0 to decode rank 0, any TP on either side (disagg/mtp_transfer.py)."""
    algo = cfg.speculative.algorithm
    if model.num_nextn_predict_layers < 1:
        raise ConfigError(
            f"--speculative-algorithm {algo} drafts with the checkpoint's multi-token-prediction layer "
            f"(DeepSeek-V3's num_nextn_predict_layers, Qwen3.5's mtp_num_hidden_layers); {cfg.model_path} "
            f"({model.architecture}) has none"
        )


def hidden_to_bytes(hidden: torch.Tensor) -> bytes:
    """[rows, H] hidden states as AuxData.hidden: raw bytes (native little-endian, any dtype)."""
    return hidden.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def hidden_from_bytes(data: bytes, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """AuxData.hidden back to [rows, H] (a copy); ValueError when it is not whole rows."""
    row = hidden_size * torch.empty(0, dtype=dtype).element_size()
    if not data:
        return torch.zeros(0, hidden_size, dtype=dtype)
    if len(data) % row:
        raise ValueError(f"{len(data)} bytes of hidden states are not whole rows of {hidden_size} x {dtype}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(-1, hidden_size)


@dataclass
class MTPSeq:
    """One request's MTP state: its MTP KV is valid for positions [0, valid); `hidden` [m, H]
    holds the target's hidden states of positions valid .. valid + m - 1 (not consumed yet)."""

    valid: int
    hidden: torch.Tensor
    # cached pages whose last row this request recomputed: their index in the request's pages ->
    # the private MTP page that stands for them in its page tables
    private: dict[int, int] = field(default_factory=dict)


class MTPDrafter(Drafter):
    uses_target_hidden = True
    moves_kv = True  # PD: its KV (rank 0's pool, the target's page ids) and h_{L-1} go to the decode

    def __init__(self, cfg: ServerConfig, target_cfg: ModelConfig, target: LMBase, num_pages: int, device: str) -> None:
        """`target`: the loaded target model (its embedding and lm_head serve where the MTP layer
        has no copy); `num_pages`: the target pool's pages, whose ids the MTP pool shares."""
        self.mtp: MTPLayer = self.load_head(cfg, target_cfg, device)
        head = target.lm_head if target.lm_head is not None else partial(F.linear, weight=target.embed_tokens)
        self.mtp.set_target(target.embed_tokens, head)
        self.page_size = cfg.cache.page_size
        self.device = torch.device(device)
        self.send_layer = target_cfg.num_layers  # PD: its KV is send layer num_layers (model layers)
        # the chain writes up to max_drafts - 1 positions past a request's pages
        scratch = _cdiv(max(cfg.speculative.max_drafts, 1), self.page_size) + 1
        self.scratch = np.arange(num_pages, num_pages + scratch, dtype=np.int64)
        # the private copies of cached pages (copy on write), two per running request
        first = num_pages + scratch
        private = 2 * cfg.scheduler.max_running_requests
        self.free_private = list(range(first + private - 1, first - 1, -1))
        self.num_private = private
        self.hit_copies = 0  # cached pages whose last MTP row a request recomputed in a private copy
        dtype = next(self.mtp.parameters()).dtype
        # the target's hidden state at the last position of each page whose MTP KV was computed
        # here: what a cache hit of that page recomputes its last MTP row from
        self.page_hidden = torch.zeros(num_pages, target_cfg.hidden_size, dtype=dtype, device=self.device)
        self.page_next = np.full(num_pages, -1, dtype=np.int64)  # and the token after it there
        self.pool: KVPool = self.mtp.kv_pool(num_pages + scratch + private, self.page_size, self.device)
        self.seqs: dict[str, MTPSeq] = {}

    def load_head(self, cfg: ServerConfig, target_cfg: ModelConfig, device: str) -> MTPLayer:
        """The drafting layer: the checkpoint's MTP layer (engine/spec/eagle_drafter.py: an EAGLE head)."""
        check_nextn(cfg, target_cfg)
        return load_mtp(cfg.model_path, target_cfg, device, dtype=None if cfg.dtype == "auto" else cfg.dtype)

    # ---- the target's hidden states -------------------------------------------------------
    @torch.inference_mode()
    def after_forward(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """After a target forward of `batch`: hidden [T, H], its rows in batch order (each row's
        extend_len of them, positions prefix_len ..). A forward at prefix p makes the rows of
        positions >= p that were kept before stale (rejected drafts): they are replaced."""
        start = 0
        for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            h = hidden[start : start + n]
            start += n
            seq = self.seqs.get(req.rid)
            if seq is None:  # its first forward: a cached prefix's MTP KV came with its pages
                self.seqs[req.rid] = self._start(req, pre, h)
                continue
            if pre < seq.valid:
                raise AssertionError(f"{req.rid}: a target forward at {pre}, below the MTP's valid KV ({seq.valid})")
            seq.hidden = torch.cat([seq.hidden[: pre - seq.valid], h])
        assert start == hidden.shape[0], (start, tuple(hidden.shape))

    def _start(self, req: Req, pre: int, h: torch.Tensor) -> MTPSeq:
        """A request's first forward, at prefix `pre`: behind a cache hit (whole pages) its
        prefix's MTP KV came with its pages; the last row of a page whose next token differs from
        this request's is recomputed in a private copy (see the module docstring)."""
        seq = MTPSeq(pre, h.clone())
        p, tokens = self.page_size, req.all_ids
        for j in range(min(pre // p, len(req.pages))):
            src = int(req.pages[j])
            nxt = int(self.page_next[src])
            if nxt < 0 or nxt == tokens[(j + 1) * p] or not self.free_private:
                continue  # unknown (nothing to recompute it from), the same token, or no room
            dst = self.free_private.pop()
            for buf in (*self.pool.k[:1], *self.pool.v[:1]):  # the MLA latent, or an EAGLE head's K and V
                buf[dst].copy_(buf[src])
            seq.private[j] = dst
            self.hit_copies += 1
            pos = (j + 1) * p - 1
            with torch.inference_mode():
                self._forward([tokens[pos + 1]], pos, self._table(req, seq, j + 1), self.page_hidden[src][None])
        return seq

    # ---- PD (disagg/mtp_transfer.py) ------------------------------------------------------
    def moving_pool(self) -> tuple[KVPool | None, int | None]:
        return self.pool, None

    def before_prefill(self, batch: ScheduledBatch) -> None:
        """The MTP page tables (private copies made) before the transfer's rooms start."""
        for req, pre in zip(batch.reqs, batch.prefix_lens):
            if req.rid not in self.seqs:
                req.draft_pages = self.begin(req, pre)

    def on_reserved(self, req: Req) -> None:
        """The prompt's MTP KV lands in its own pages (the MTP pool shares the target's page ids)."""
        req.draft_pages = req.pages[: _cdiv(len(req.input_ids), self.page_size)].copy()

    def begin(self, req: Req, pre: int) -> np.ndarray:
        """PD prefill, before `req`'s first forward (at prefix `pre`): its MTP state, with the
        private copies of cached pages made now, so the MTP page table of its prompt (returned,
        whole prompt) is final before the transfer starts reading it. Idempotent."""
        seq = self.seqs.get(req.rid)
        if seq is None:
            seq = self.seqs[req.rid] = self._start(req, pre, self.page_hidden[:0])
        return self._table(req, seq, _cdiv(len(req.input_ids), self.page_size))

    def prefill_forward(self, batch: ScheduledBatch, send: LayerSend | None) -> None:
        """The chunk's MTP KV, sent as the last layer group; a row whose prompt it completes
        carries h_{L-1} with its first token (req.draft_hidden, AuxData.hidden)."""
        self._prefill_forward(batch)
        for i, req in enumerate(batch.reqs):
            if batch.completes_prefill(i):
                req.draft_hidden = self.pending_hidden(req.rid)
        if send is not None:
            send.send(self.send_layer, self.send_layer + 1)

    @torch.inference_mode()
    def _prefill_forward(self, batch: ScheduledBatch) -> None:
        """PD prefill, after the target's forward of `batch` (after_forward took its hidden
        states): the MTP KV of each row's positions up to the chunk's end, at most to L - 1 of an
        L-token prompt (row L - 1 needs the first sampled token: the decode computes it)."""
        for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            seq = self.seqs.get(req.rid)
            end = min(pre + n, len(req.input_ids) - 1)
            if seq is not None and end > seq.valid:
                self._catch_up(seq, req, end, self._table(req, seq, _cdiv(end, self.page_size)))

    def pending_hidden(self, rid: str) -> bytes:
        """The hidden states kept for `rid` past its valid MTP KV, as AuxData.hidden carries them
        (raw [rows, H] in the MTP's dtype; after the prompt's last prefill_forward: h_{L-1})."""
        seq = self.seqs.get(rid)
        return b"" if seq is None else hidden_to_bytes(seq.hidden)

    def kv_arrived(self, req: Req, num_tokens: int, data: bytes) -> None:
        """PD decode: the prefill wrote `req`'s MTP KV of the prompt's positions past the decode's
        prefix (into its target pages) and sent `data` (AuxData.hidden, [rows, H]), the target's
        hidden states of the positions [num_tokens - rows, num_tokens) whose MTP KV it did not
        compute: they are this request's pending rows, so its first propose() catches up on them
        only. The pages that arrived had their last rows computed elsewhere, from hidden states
        not kept here: unknown to a later hit's copy on write. ValueError (and no MTP state: the
        request decodes without drafts) when they do not fit the prompt."""
        hidden = hidden_from_bytes(data, self.page_hidden.shape[1], self.page_hidden.dtype).to(self.device)
        p = self.page_size
        pre = req.num_shared_pages * p
        self.page_next[req.pages[pre // p : _cdiv(len(req.input_ids), p)]] = -1
        seq = self.seqs[req.rid] = self._start(req, pre, hidden)
        seq.valid = num_tokens - hidden.shape[0]
        if not pre <= seq.valid < len(req.input_ids):
            self.release(req.rid)  # no drafts for it (its outputs stay the target's)
            raise ValueError(
                f"{req.rid}: NEXTN state of {num_tokens} prompt tokens with {hidden.shape[0]} hidden rows "
                f"does not fit its {len(req.input_ids)}-token prompt past its {pre}-token cached prefix"
            )

    def _table(self, req: Req, seq: MTPSeq, used: int) -> np.ndarray:
        """The MTP page table of `req`'s first `used` pages: its target pages, with its private
        copies standing for the cached pages whose last row it recomputed."""
        table = np.array(req.pages[:used], dtype=np.int64)
        for j, dst in seq.private.items():
            if j < used:
                table[j] = dst
        return table

    # ---- drafting ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, req: Req, num_drafts: int) -> list[int]:
        """Up to `num_drafts` greedy drafts for decode row `req` (its tokens: req.all_ids, the
        target's KV holding all but the last)."""
        seq = self.seqs.get(req.rid)
        tokens = req.all_ids
        end = len(tokens) - 1  # the MTP KV needed: positions [0, end)
        if seq is None or num_drafts <= 0 or seq.valid >= end:
            return []
        table = np.concatenate([self._table(req, seq, _cdiv(end, self.page_size)), self.scratch])
        out, logits = self._catch_up(seq, req, end, table)
        drafts = [int(torch.argmax(logits[0]).item())]
        h, pos = out[-1:], end
        while len(drafts) < num_drafts:
            h, logits = self._forward([drafts[-1]], pos, table, h)
            drafts.append(int(torch.argmax(logits[0]).item()))
            pos += 1
        return drafts

    def finish(self, req: Req) -> None:
        """`req` ends normally and its full pages go to the radix cache: compute the MTP KV of
        every position on them first (a request that stopped right after a verify never had
        the catch-up of its last tokens)."""
        seq = self.seqs.get(req.rid)
        if seq is None:
            return
        full = min(req.num_cached // self.page_size, len(req.pages)) * self.page_size
        end = min(full, len(req.all_ids) - 1)
        if end > seq.valid:
            with torch.inference_mode():
                self._catch_up(seq, req, end, self._table(req, seq, _cdiv(end, self.page_size)))

    def release(self, rid: str) -> None:
        """The request ended (finished, aborted, failed): drop its state; its MTP KV pages are
        the target's and go back with them, its private copy here (idempotent)."""
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.free_private.extend(seq.private.values())

    # ---- forwards -------------------------------------------------------------------------
    def _catch_up(self, seq: MTPSeq, req: Req, end: int, table: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP KV of positions [seq.valid, end) of `req`: (h_i, t_{i+1}) for each; returns the
        extend forward's (out [n, H], logits [1, V] of its last row)."""
        start, n = seq.valid, end - seq.valid
        if n > seq.hidden.shape[0]:
            raise AssertionError(
                f"MTP catch-up of positions [{start}, {end}) but hidden states of [{start}, "
                f"{start + seq.hidden.shape[0]}) only"
            )
        # the hidden state of each page's last position, for cache hits of the page
        p = self.page_size
        last = np.arange(start + (p - 1 - start) % p, end, p)
        if seq.private:  # a shared page keeps the row (and token) it was cached with
            last = last[~np.isin(last // p, list(seq.private))]
        if last.size:
            pages = req.pages[last // p].astype(np.int64)
            self.page_hidden[torch.from_numpy(pages)] = seq.hidden[torch.from_numpy(last - start)]
            self.page_next[pages] = np.asarray(req.all_ids, dtype=np.int64)[last + 1]
        out, logits = self._forward(req.all_ids[start + 1 : end + 1], start, table, seq.hidden[:n])
        seq.hidden = seq.hidden[n:]  # consumed: positions before `end` are never needed again
        seq.valid = end
        return out, logits

    def _forward(
        self, token_ids: list[int], prefix_len: int, table: np.ndarray, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row of the MTP: tokens at positions prefix_len .., their h rows `hidden`."""
        used = _cdiv(prefix_len + len(token_ids), self.page_size)
        pages = torch.from_numpy(np.ascontiguousarray(table[:used], dtype=np.int64))
        fb = ForwardBatch.build([list(token_ids)], [prefix_len], [pages], self.page_size, [True])
        if self.device.type != "cpu":
            fb = fb.to(self.device)
        return self.mtp(hidden, fb, self.pool)

    @property
    def num_tracked(self) -> int:
        return len(self.seqs)
