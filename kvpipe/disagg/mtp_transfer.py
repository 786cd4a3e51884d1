"""PD with NEXTN (DeepSeek-V3's multi-token-prediction layer, engine/spec/mtp_drafter.py, issue 27):
the prefill runs the MTP layer over the prompt and sends its one-layer latent KV with the
target's, plus the target's last hidden state, so the decode drafts at once with nothing over
the prompt recomputed (SGLang sends the same for EAGLE/MTP: the first token and hidden states).

It reuses the STANDALONE path (disagg/draft_transfer.py): the MTP pool is the "draft" pool both
sides register and announce (TransferWorker.set_draft_pool, RegisterPeer.draft), its layer is
send layer num_layers, the last layer group of a layer-pipelined forward. What differs:
- pages: the MTP pool has the target pool's page ids (mtp_drafter.py), so a request's MTP pages
  are its target pages (the prefill's with its private copy-on-write pages standing in,
  MTPDrafter.begin), and a decode's cached prefix holds the MTP KV of that prefix with the
  target's: both sides send/ask from the decode's prefix_len (SenderBook's draft_at_prefix);
- positions: the MTP row of position i is computed from (h_i, t_{i+1}); the prefill computes
  rows 0 .. L - 2 of an L-token prompt chunk by chunk, right after each chunk's target forward
  (MTPDrafter.prefill_forward; row L - 1 needs the first sampled token, which comes after the
  forward, so the last group cannot carry it). AuxData.draft_tokens is L, AuxData.hidden the
  target's hidden state h_{L-1} (after its final norm, one row, the MTP's dtype): the decode
  takes rows [0, L - 1) as valid and h_{L-1} as its pending hidden row (MTPDrafter.kv_arrived),
  so its first proposal catches up row L - 1 from (h_{L-1}, first token) and drafts, as the
  colocated engine's first proposal after its prefill does over the whole prompt. Row L - 1 on
  the wire is whatever the prefill's page held there: the decode overwrites it before reading it;
- a cached page's last MTP row depends on the token after it (mtp_drafter.py's copy on write):
  the decode does not know the hidden states of pages that arrived by transfer, so it marks them
  unknown. A later decode radix hit that ends exactly where its prompt leaves the cached one (a
  branch at a page boundary: only the hit's last page can be affected) keeps that page's last
  row as cached: that request's drafts may differ from a colocated engine's, outputs never.

SGLang, for comparison (disaggregation/utils.py MetadataBuffers): its prefill runs the draft
extend after sampling and writes, per request, the first token, the draft's top-k probabilities
and indices and a hidden state into registered aux buffers on the decode (the data plane). Here
the MTP row that needs the sampled token is left to the decode (one MTP row at its first step),
so no top-k travels, and the hidden row rides in the final TransferStatus frame (H x itemsize
bytes: 14 KiB for DeepSeek-V3 in bf16), after every KV write of the room has landed.

Tensor parallelism, the same or different on the two sides (TP (1,2), (2,1), (2,2), ...): the MTP
layer runs whole on TP rank 0 of each side (engine/spec/mtp_drafter.py: the target's last hidden states,
its embedding and lm_head are whole on every rank), so its KV pool, the MLA latent (TP-invariant,
never head-sliced), exists on rank 0 only: MTP_RANK. Rank 0 of every rank mapping pairs prefill
rank 0 with decode rank 0 (tp_mapping.source_ranks(0, P, D) holds 0), so that pair moves it, once:
- only rank 0's TransferWorker registers an MTP pool (the engine's ConnectorContext.draft_pool;
  TP children have none), so only decode rank 0 announces one (RegisterPeer.draft) and is asked
  for it (TransferRequest.dst_draft_pages: the receiver asks the ranks that hold a draft pool);
- the sender books run with `draft_rank=MTP_RANK` (sender/peers.py): prefill rank 0 writes the
  whole pool into decode rank 0 and nowhere else; a prefill rank without it accepts decode rank
  0's registration and never sends MTP KV; an MTP pool announced by another decode rank is refused;
- the aux data's draft fields (draft_tokens, hidden) are rank 0's: prefill ranks without the MTP
  KV send 0 and b"" (SenderBook drops the hidden row a rank without a draft pool was handed),
  and the decode merges every rank's aux, taking the draft fields from the ranks that have some
  (receiver/room.py merge_aux);
- the MTP layer's send layer is num_layers on rank 0 (its last layer group, sent from the
  engine's thread after the MTP forward); the other ranks' sends stop at their target layers.
Bytes per request: the target's KV as the head-slice mapping moves it plus the MTP KV once.
An EAGLE head (engine/spec/eagle_drafter.py) takes the MTP layer's place on rank 0 with the same
placement: every decision above keys on the drafter registry's `DraftKV.RANK0` (NEXTN or EAGLE), so its
pool, the K and V of all the head's KV heads (a GQA layer, but never head-sliced: the head runs
whole on rank 0), moves whole from prefill rank 0 into decode rank 0 at any TP on either side,
while the target's K/V moves head-sliced as TP maps it.

The handshake's speculative field (`nextn_handshake`) names NEXTN, the MTP layer (its index and
count in the checkpoint, whose content the handshake's model digest covers), the hidden size the
aux carries, the MTP KV layout and where it lives (`at=rank0`: whole on TP rank 0, whatever the
TP size, so servers of different TP agree); a prefill and a decode that disagree refuse each other.
"""

from __future__ import annotations

from kvpipe.config import ServerConfig
from kvpipe.engine.connector import ConnectorContext
from kvpipe.engine.spec.registry import DraftKV, draft_kv
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.identity import checkpoint_digest
from kvpipe.transfer.planning.layout import KVLayout

# hidden rows AuxData.hidden carries: h_{L-1} (MTPDrafter.pending_hidden after the prompt)
AUX_HIDDEN_ROWS = 1
# the TP rank of each side that runs the MTP layer (or EAGLE head) and holds its KV (whole, not sharded)
MTP_RANK = 0


def nextn_handshake(cfg: ServerConfig, mtp: KVLayout | None) -> str:
    """Handshake.speculative of a NEXTN (or EAGLE without a draft model) PD server:
    "nextn:mtp=layer<index>x<count>:hidden=<size>:kv=<dtype>/<page size>/<kind>x<layers>x<heads>x<head dim>
    :at=rank<MTP_RANK>" (where the MTP KV lives on each side: the same for every TP size)."""
    if mtp is None:
        raise ValueError("a NEXTN server's handshake needs its MTP layer's KV layout")
    if cfg.speculative.eagle_head_path is not None:  # an EAGLE head drafts in the MTP layer's place
        return eagle_handshake(cfg, mtp)
    model = model_config_of(cfg.model_path)
    shape = f"{mtp.buffers_per_layer}x{mtp.num_layers}x{mtp.total_kv_heads}x{mtp.head_dim}"
    layer = f"layer{model.num_layers}x{model.num_nextn_predict_layers}"
    kv = f"{mtp.dtype}/{mtp.page_size}/{shape}"
    return f"nextn:mtp={layer}:hidden={model.hidden_size}:kv={kv}:at=rank{MTP_RANK}"


def nextn_aux_nbytes(cfg: ServerConfig, ctx: ConnectorContext) -> int:
    """The largest AuxData.hidden a NEXTN decode accepts: AUX_HIDDEN_ROWS rows of the target's
    hidden size in the MTP's dtype (its KV pool's, ctx.draft_pool); 0 without NEXTN."""
    pool = ctx.draft_pool
    if draft_kv(cfg.speculative) is not DraftKV.RANK0 or pool is None:
        return 0
    return AUX_HIDDEN_ROWS * ctx.model_config.hidden_size * pool.k[0].element_size()


def eagle_handshake(cfg: ServerConfig, head: KVLayout) -> str:
    """Handshake.speculative of an EAGLE server with a draft head (engine/spec/eagle_drafter.py), whose
    KV and hidden state move as NEXTN's do: "eagle:head=<head checkpoint digest>:hidden=<size>:
    kv=<dtype>/<page size>/<kind>x<layers>x<heads>x<head dim>:at=rank<MTP_RANK>" (its GQA layer:
    kind 2, K and V; `at`: all its KV heads live whole on TP rank 0 of each side, whatever the TP
    size, so servers of different TP agree)."""
    path = cfg.speculative.eagle_head_path
    assert path is not None
    hidden = model_config_of(cfg.model_path).hidden_size
    shape = f"{head.buffers_per_layer}x{head.num_layers}x{head.total_kv_heads}x{head.head_dim}"
    kv = f"{head.dtype}/{head.page_size}/{shape}"
    return f"eagle:head={checkpoint_digest(path)}:hidden={hidden}:kv={kv}:at=rank{MTP_RANK}"
