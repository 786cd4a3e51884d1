"""A prefill room's transfer, as phases of its request's timeline (kvpipe/engine/timeline.py).

The sender (TP rank 0, in the engine's process, on time.monotonic) reports each room that
succeeded as a `TransferTiming`; the PrefillConnector hands it here when the room finishes.
"""

from __future__ import annotations

from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.transfer.sender.book import TransferTiming


def record_transfer(timeline: Timeline, timing: TransferTiming | None) -> None:
    """Bootstrap, first write and last write of a room (nothing when rank 0 reported no timing)."""
    if timing is None:
        return
    if timing.requested_at is not None:
        timeline.mark(Phase.BOOTSTRAPPED, timing.requested_at)
    if timing.first_submit_at is not None:
        timeline.mark(Phase.TRANSFER_START, timing.first_submit_at)
    if timing.last_done_at is not None:
        timeline.mark(Phase.TRANSFER_DONE, timing.last_done_at, timing.nbytes)
    timeline.transfer_bytes = timing.nbytes
