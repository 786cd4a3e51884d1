"""PD with a STANDALONE draft model (issue 27): the prefill runs the draft over the prompt and
sends its KV with the target's, so the decode drafts at once with nothing recomputed.

Flow (any TP on either side: the draft model is sharded like the target, engine/spec/draft_model.py):
- every rank of both sides registers its shard of the draft model's KV pool with its backend next
  to the target's (TransferWorker.set_draft_pool, setup.register_pool; a TP child's from its own
  draft runner, tp_group.py); a decode rank announces its draft pool (its head range among the
  draft's KV heads) in RegisterPeer.draft, checked against the prefill's (sender/peers.py);
- heterogeneous TP: the draft's heads pair up by the target's rank mapping over the draft's own
  head count (SenderPeers.draft_heads; a replicated draft head is sent by one prefill rank), and
  each page's head slice is one op per (layer, K/V, page run) of the head-major layout, never
  staged (sender/room.py);
- the decode reserves draft-pool pages for the whole prompt next to the target's (the engine,
  DraftModel.reserve_prompt; none when its draft pool is full: the request then catches up on the
  prompt at its first decode step, as without PD) and asks for them in
  TransferRequest.dst_draft_pages, from token 0 whatever prefix its radix cache holds;
- the prefill reserves draft pages for the whole prompt at the request's first forward, runs the
  draft over each chunk right after the target (DraftModel.prefill_forward) and the sender moves
  them as the layers after the target's: draft layer i is send layer num_layers + i, one more
  layer group at the end of a layer-pipelined forward (sender/room.py), flushed with the rest by
  the last chunk's send;
- the aux data says how many prompt tokens of draft KV were written (AuxData.draft_tokens) and
  the decode's draft book takes them as valid (DraftModel.kv_arrived): its first step extends
  the draft over the first sampled token only, as a colocated engine's does after its prefill;
- a failed or aborted transfer frees the draft pages with the target's, on both sides, once no
  write can land in them any more (the engine keeps them while a transfer holds the request).

The speculative settings that change what moves are in the PD handshake (control/handshake.py):
`speculative_handshake` names the algorithm, the draft checkpoint's digest and the draft KV
layout; a prefill and a decode that disagree refuse each other at bootstrap. NGRAM moves nothing
(the decode drafts from the request's own tokens), so it counts as "none".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpipe.config import ServerConfig
from kvpipe.disagg.mtp_transfer import nextn_handshake
from kvpipe.disagg.setup import rank_layout
from kvpipe.engine.spec.registry import DraftKV, draft_kv
from kvpipe.model.checkpoint.identity import checkpoint_digest
from kvpipe.transfer.control.handshake import SPECULATIVE_NONE
from kvpipe.transfer.planning.layout import KVLayout

if TYPE_CHECKING:
    from kvpipe.cache.kv_pool import KVPool


def draft_layout(cfg: ServerConfig, rank: int, pool: KVPool, total_kv_heads: int | None = None) -> KVLayout:
    """A TP rank's shard of the draft model's pool as the transfer layer sees it: its head range
    among the draft's `total_kv_heads` (None: the pool holds every head, TP 1), split like the
    target's (setup.rank_layout)."""
    return rank_layout(cfg, rank, pool, pool.kv_heads if total_kv_heads is None else total_kv_heads)


def speculative_handshake(cfg: ServerConfig, draft: KVLayout | None) -> str:
    """Handshake.speculative of a PD server: "none", or for a STANDALONE draft model
    "standalone:draft=<checkpoint digest>:kv=<dtype>/<page size>/<kind>x<layers>x<heads>x<head dim>"."""
    spec = cfg.speculative
    kind = draft_kv(spec)
    if kind is DraftKV.RANK0:  # NEXTN: its MTP layer's KV is the "draft" KV (mtp_transfer.py)
        return nextn_handshake(cfg, draft)
    path = spec.draft_model_path
    if kind is not DraftKV.SHARDED or path is None:  # NGRAM moves nothing
        return SPECULATIVE_NONE
    if draft is None:  # a hybrid target or draft: no draft KV moves, the decode's draft catches up
        return f"{str(spec.algorithm).lower()}:draft={checkpoint_digest(path)}:kv=none"
    shape = f"{draft.buffers_per_layer}x{draft.num_layers}x{draft.total_kv_heads}x{draft.head_dim}"
    kv = f"{draft.dtype}/{draft.page_size}/{shape}"
    return f"{str(spec.algorithm).lower()}:draft={checkpoint_digest(path)}:kv={kv}"
