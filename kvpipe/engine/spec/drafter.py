"""What the engine asks of a speculative drafter: one interface for every --speculative-algorithm
(engine/spec/registry.py builds the configured one), so the engine never asks which it runs.

| engine moment | hook |
|---|---|
| a decode step is scheduled | `propose(req, max_drafts)` -> the row's drafts |
| after every target forward (`uses_target_hidden`) | `after_forward(batch, hidden)` |
| a request finishes normally and its pages go to the prefix cache | `finish(req)` |
| any end of a request, once no transfer holds its pages | `release(rid)` |
| PD prefill (EngineRole.drafts_on_prefill, `moves_kv`): before a prompt chunk's forward | `before_prefill(batch)` |
| PD prefill: after it | `prefill_forward(batch, send)`: the chunk's draft KV, then its layers sent |
| PD decode: a REMOTE request got its prompt's pages | `on_reserved(req)` |
| PD decode: its KV arrived | `kv_arrived(req, draft_tokens, draft_hidden)` |

NGRAM (ngram_drafter.py) proposes from the request's own tokens and needs none of the other
hooks; the draft model (draft_model.py) and the MTP layer (mtp_drafter.py, an EAGLE head in
eagle_drafter.py) keep draft KV per request and implement them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import Req

if TYPE_CHECKING:
    import torch

    from kvpipe.cache.kv_pool import KVPool


@dataclass(frozen=True)
class LayerSend:
    """A PD prefill forward's send of the layers after the target's (its draft KV): `meta` is the
    forward's connector meta (TP children's workers ship their own shard with it), `send(start,
    end)` ships rank 0's send layers [start, end)."""

    meta: object
    send: Callable[[int, int], None]


class Drafter(ABC):
    # the target's runner keeps each forward's last hidden states for after_forward (NEXTN, EAGLE)
    uses_target_hidden: bool = False
    # PD: its draft KV moves with the target's (the prefill computes it over the prompt)
    moves_kv: bool = False

    @abstractmethod
    def propose(self, req: Req, max_drafts: int) -> list[int]:
        """Up to `max_drafts` draft tokens after decode row `req`'s tokens (req.all_ids)."""

    def after_forward(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """After a target forward of `batch`: hidden [T, H], its rows in batch order."""

    def finish(self, req: Req) -> None:
        """`req` ends normally and its full pages go to the prefix cache."""

    def release(self, rid: str) -> None:
        """The request ended (finished, aborted, failed) and no transfer holds its pages."""

    def moving_pool(self) -> tuple[KVPool | None, int | None]:
        """PD: the draft KV pool whose pages move with the target's (rank 0's), and the draft's KV
        heads before TP (None: the pool's own); (None, None) when nothing moves."""
        return None, None

    def before_prefill(self, batch: ScheduledBatch) -> None:
        """PD prefill, before the forward of a prompt chunk (and before the connector plans it):
        each row's draft page table (req.draft_pages), final before its transfer starts."""

    def prefill_forward(self, batch: ScheduledBatch, send: LayerSend | None) -> None:
        """PD prefill, after the target's forward of a prompt chunk: the draft KV of the chunk,
        then `send` its layers (None: no connector worker)."""

    def on_reserved(self, req: Req) -> None:
        """PD decode: REMOTE `req` got its prompt's pages; the draft pages its draft KV lands in."""

    def kv_arrived(self, req: Req, num_tokens: int, hidden: bytes) -> None:
        """PD decode: the prefill wrote the draft KV of the prompt's first `num_tokens` tokens and
        sent `hidden` (AuxData.hidden). ValueError: it does not fit (the request drafts cold)."""
