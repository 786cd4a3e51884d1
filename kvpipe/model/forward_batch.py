"""What one forward pass needs besides weights: packed tokens and where their KV lives.

Tokens of all sequences in the batch are packed along one dim T (varlen, no padding). Each
sequence contributes `extend_len` new tokens that follow `prefix_len` tokens already in the
KV pool (0 for a fresh prefill, the context so far for a decode step or a later chunk).

Sliding-window models carry a second view, `swa`: the same tokens over the sliding layers' own
page tables (entries before the window are -1 and never read), whose decode index starts each
row at the first page its window reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpipe.cache.window_pages import window_first_page


@dataclass(frozen=True)
class SeqSpan:
    start: int  # offset of this sequence's first new token in the packed batch
    extend_len: int  # new tokens in this forward
    prefix_len: int  # tokens of this sequence already in the KV pool
    page_table: torch.Tensor  # [n_pages] int64, covers prefix_len + extend_len tokens

    @property
    def total_len(self) -> int:
        return self.prefix_len + self.extend_len


@dataclass(frozen=True)
class DecodeIndex:
    """Where a decode batch's KV lives, built once per forward and shared by every layer.

    Every row has extend_len 1, so the whole batch attends in one pass over its pages, padded to
    the longest row's page count (the padding points at page 0 and is masked out). A sliding
    layer's index starts each row at the first page its window reaches (`key_start`).
    """

    pages: torch.Tensor  # [B * n_pages] int64, row-major: row b's pages, then padding
    valid: torch.Tensor  # [B, n_pages, 1, 1, page_size] bool, True where a key is in the row's context
    lens: torch.Tensor  # [B] int64: each row's context length, its new token included
    key_start: torch.Tensor  # [B] int64: position of the first key of each row's first page

    @property
    def batch_size(self) -> int:
        return int(self.valid.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.valid.shape[1])

    @property
    def page_table(self) -> torch.Tensor:
        """`pages` as [B, n_pages] (a view), the layout the CPU decode kernel walks."""
        return self.pages.view(self.batch_size, self.num_pages)

    @classmethod
    def build(cls, seqs: tuple[SeqSpan, ...], page_size: int, window: int | None = None) -> DecodeIndex:
        """window: index only the pages each row's window reaches (its new token at total_len - 1)."""
        lens = [s.total_len for s in seqs]
        first = [0 if window is None else window_first_page(n - 1, window, page_size) for n in lens]
        used = [-(-n // page_size) for n in lens]
        n = max(u - f for u, f in zip(used, first))
        pages = torch.zeros(len(seqs), n, dtype=torch.int64)
        for b, s in enumerate(seqs):
            pages[b, : used[b] - first[b]] = s.page_table[first[b] : used[b]]
        key_start = torch.tensor(first, dtype=torch.int64) * page_size
        lens_t = torch.tensor(lens, dtype=torch.int64)
        key_pos = key_start[:, None] + torch.arange(n * page_size)[None, :]  # [B, n * page_size]
        valid = key_pos < lens_t[:, None]
        return cls(pages.view(-1), valid.view(len(seqs), n, 1, 1, page_size), lens_t, key_start)

    def window_valid(self, window: int) -> torch.Tensor:
        """`valid` of a sliding-window layer: only each row's last `window` keys (its new one
        included) -> [B, n_pages, 1, 1, page_size] bool."""
        b, n, _, _, page = self.valid.shape
        key_pos = self.key_start.view(b, 1, 1, 1, 1) + torch.arange(n * page, device=self.valid.device).view(
            1, n, 1, 1, page
        )
        return self.valid & (key_pos >= (self.lens - window).view(b, 1, 1, 1, 1))

    def to(self, device: torch.device | str) -> DecodeIndex:
        return DecodeIndex(
            self.pages.to(device), self.valid.to(device), self.lens.to(device), self.key_start.to(device)
        )


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_pages: torch.Tensor  # [T] int64, page that receives each new token's K/V
    slot_offsets: torch.Tensor  # [T] int64, offset inside that page
    seqs: tuple[SeqSpan, ...]
    logit_indices: torch.Tensor  # [B_out] int64, packed rows whose logits are wanted
    decode: DecodeIndex | None = None  # set when every row adds exactly one token to a context
    # [B] int64, each row's slot in the StatePool (hybrid models only): a row with prefix_len 0
    # starts from a zero state, any other from its slot's; the forward writes the slot back
    state_slots: torch.Tensor | None = None
    # sliding-window models: this batch over the sliding layers' page tables (swa=None there)
    swa: ForwardBatch | None = None
    # hybrid prefix cache: per row, (k, slot) pairs: after its first k new tokens the row's state
    # is copied into StatePool slot `slot` (model/layers/gated_delta_net.py); None: no row snapshots
    state_snapshots: tuple[tuple[tuple[int, int], ...], ...] | None = None
    # hybrid speculative verify: every row (its last token and its drafts) keeps the state after
    # each of its inputs in StatePool.verify (cache/verify_states.py)
    verify_states: bool = False
    # layer-pipelined prefill: called with a layer's index once its new K/V are in the pool, before
    # its attention and MLP compute (model/layers/attention.py, model/layers/mla.py): the runner ships a layer
    # group's KV from there, so the wire starts while the group's last layer still computes
    kv_stored: Callable[[int], None] | None = None
    # a MIXED step (--enable-mixed-chunk): prompt rows, then decode rows; the index of those decode
    # rows (seqs[-decode_tail.batch_size:], the batch's last tokens), so their attention is one
    # decode pass, bit for bit a plain decode step's, not a prefill row each
    decode_tail: DecodeIndex | None = None

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        prefix_lens: list[int],
        page_tables: list[torch.Tensor],
        page_size: int,
        want_logits: list[bool] | None = None,
        state_slots: list[int] | None = None,
        swa_page_tables: list[torch.Tensor] | None = None,
        window: int | None = None,
        logit_counts: list[int] | None = None,
        state_snapshots: list[tuple[int, int, int]] | None = None,
        verify_states: bool = False,
    ) -> ForwardBatch:
        """Pack sequences. token_ids[i] are the new tokens of sequence i (extend_len of them).
        swa_page_tables (with the sliding layers' `window`): build the `swa` view too. A batch
        built with a window and no swa tables is itself such a view. logit_counts[i]: logits of
        the last that many tokens of row i (a speculative verify), else of its last token."""
        seqs, ids, pos, start = [], [], [], 0
        for toks, pre, table in zip(token_ids, prefix_lens, page_tables):
            seqs.append(SeqSpan(start, len(toks), pre, table))
            ids.extend(toks)
            pos.append(torch.arange(pre, pre + len(toks), dtype=torch.int64))
            start += len(toks)
        positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
        pages = torch.cat([s.page_table[p // page_size] for s, p in zip(seqs, pos)]) if seqs else positions
        want = want_logits if want_logits is not None else [True] * len(seqs)
        counts = logit_counts if logit_counts is not None else [1] * len(seqs)
        ends = [(s.start + s.extend_len, c) for s, w, c in zip(seqs, want, counts) if w]
        last = [i for end, c in ends for i in range(end - c, end)]
        swa = None
        if swa_page_tables is not None:
            if window is None:
                raise ValueError("sliding-window page tables need the window")
            swa = cls.build(
                token_ids,
                prefix_lens,
                swa_page_tables,
                page_size,
                want_logits,
                state_slots,
                window=window,
                logit_counts=logit_counts,
            )
            window = None  # this batch's own decode index covers whole contexts
        tail = _decode_tail(seqs)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=positions,
            slot_pages=pages,
            slot_offsets=positions % page_size,
            seqs=tuple(seqs),
            logit_indices=torch.tensor(last, dtype=torch.int64),
            # a fresh 1-token prompt is a prefill: it attends to its own new K/V, not to what the
            # pool stores (a low-precision pool would round it), as it would packed with others
            decode=DecodeIndex.build(tuple(seqs), page_size, window)
            if seqs and all(_is_decode(s) for s in seqs)
            else None,
            state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64),
            swa=swa,
            state_snapshots=_row_snapshots(len(seqs), state_snapshots),
            verify_states=verify_states,
            decode_tail=DecodeIndex.build(tail, page_size, window) if tail else None,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> ForwardBatch:
        return ForwardBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            self.slot_pages.to(device),
            self.slot_offsets.to(device),
            tuple(SeqSpan(s.start, s.extend_len, s.prefix_len, s.page_table.to(device)) for s in self.seqs),
            self.logit_indices.to(device),
            None if self.decode is None else self.decode.to(device),
            None if self.state_slots is None else self.state_slots.to(device),
            None if self.swa is None else self.swa.to(device),
            self.state_snapshots,
            self.verify_states,
            decode_tail=None if self.decode_tail is None else self.decode_tail.to(device),
        )


def _row_snapshots(
    num_rows: int, snaps: list[tuple[int, int, int]] | None
) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """(row, k, slot) triples -> per row its (k, slot) pairs in token order; None when empty."""
    if not snaps:
        return None
    rows: list[list[tuple[int, int]]] = [[] for _ in range(num_rows)]
    for row, k, slot in snaps:
        rows[row].append((k, slot))
    return tuple(tuple(sorted(r)) for r in rows)


def _is_decode(s: SeqSpan) -> bool:
    return s.extend_len == 1 and s.prefix_len > 0


def _decode_tail(seqs: list[SeqSpan]) -> tuple[SeqSpan, ...]:
    """The decode rows after a batch's last row that is not one (a MIXED step's): none where
    every row decodes (a plain decode step: ForwardBatch.decode) or the last row prefills."""
    n = len(seqs)
    first = n
    while first > 0 and _is_decode(seqs[first - 1]):
        first -= 1
    return tuple(seqs[first:]) if 0 < first < n else ()
