"""A decode rank's TransferRequest, validated (peers.py `check_request`), as the `Destination` a
room writes into (room.py): its pages, its head slice, one send cursor per layer, its staging
ring, state slot, window and draft pages."""

from __future__ import annotations

import numpy as np

from kvpipe.transfer.control.messages import RegisterPeer, TransferRequest
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.sender.plan_types import Destination


def destination(
    msg: TransferRequest,
    peer: RegisterPeer,
    layout: KVLayout,
    heads: tuple[int, int] | None,
    *,
    draft_layout: KVLayout | None = None,
    draft_at_prefix: bool = False,
    draft_heads: tuple[int, int] | None = None,
    expected: int = 1,
) -> Destination:
    """`peer`: the session's registration; `layout`, `draft_layout`: this rank's pools; `heads`,
    `draft_heads`: the global KV heads this rank writes there (SenderPeers'); `draft_at_prefix`:
    the draft KV is sent from the decode's prefix like the target's (SenderBook says when);
    `expected`: how many decode ranks the request's claim group expects (claims.py)."""
    swa = None if msg.dst_swa_pages is None else np.asarray(msg.dst_swa_pages, dtype=np.int64)
    lead = 0 if swa is None else swa.size - len(msg.dst_pages)  # check_request: <= prefix pages
    return Destination(
        msg.session_id,
        peer.tp_rank,
        peer.control_address,
        peer.data_address,
        peer.layout,
        np.asarray(msg.dst_pages, dtype=np.int64),
        msg.prefix_len,
        heads,
        # target layers from the decode's prefix on, draft layers (if any) from 0 (NEXTN's
        # MTP layer from the prefix too: draft_at_prefix)
        np.concatenate(
            (
                np.full(layout.num_layers, msg.prefix_len, dtype=np.int64),
                np.full(
                    0 if draft_layout is None else draft_layout.num_layers,
                    msg.prefix_len if draft_at_prefix else 0,
                    dtype=np.int64,
                ),
            )
        ),
        peer.staging,
        peer.state,
        msg.state_slot,
        None if peer.state is None else np.zeros(peer.state.num_linear, dtype=bool),
        None if swa is None else swa[lead:],
        draft_layout=None if msg.dst_draft_pages is None else peer.draft,
        dst_draft_pages=None if msg.dst_draft_pages is None else np.asarray(msg.dst_draft_pages, dtype=np.int64),
        draft_heads=draft_heads,
        # window pages of logical pages [prefix - lead, prefix): below the decode's prefix
        dst_swa_lead=None if swa is None or lead == 0 else swa[:lead],
        swa_lead_sent=None if swa is None or lead == 0 else np.zeros(layout.num_layers, dtype=bool),
        claim=msg.claim,
        expected=expected,
        integrity_key=msg.integrity_key,
    )
