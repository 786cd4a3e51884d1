"""A decode the prefill declared dead that speaks again gets fresh connections (issue 50).

During a partition longer than the heartbeat timeout, each TCP connection with data on the wire
(our control socket to the decode: heartbeats, answers; the backend's data connections: KV)
doubles its retransmission timer through the outage. After a 15 s partition the next resend came
up to ~14 s after the heal (docs/faults.md: `ss` showed backoff 6, rto 13.8 s), and whatever we
sent on those connections waited for it: the challenge answering the decode's new registration,
the statuses, the KV of the router's retries. A fresh connection goes out at once.

So the first message heard from a dead decode's control address, before anything is sent back
to it, drops our control socket to it (the next send connects again) and names the data
addresses of its sessions for the backend to reconnect to (`TransferBackend.relink`). Once per
death: the answer to that first message leaves on the new socket, which must not be dropped again
(a closed ZMQ socket loses what it queued). Pure bookkeeping, like the rest of the SenderBook.
"""

from __future__ import annotations

from kvpipe.transfer.sender.peers import SenderPeers


class Revivals:
    """Dead control addresses given fresh connections since they died."""

    def __init__(self) -> None:
        self._relinked: set[str] = set()

    def died(self, control_address: str) -> None:
        """The peers declared it dead (again): its next word gets fresh connections."""
        self._relinked.discard(control_address)

    def heard(self, control_address: str, peers: SenderPeers) -> list[str] | None:
        """A message from `control_address`. None: nothing to do (alive, or already relinked since it
        died); else reconnect to it now, and the data addresses of its sessions for the backend."""
        self._relinked &= peers.liveness.dead  # forgotten or revived addresses leave (bounded)
        if control_address not in peers.liveness.dead or control_address in self._relinked:
            return None
        self._relinked.add(control_address)
        return sorted({p.data_address for p in peers.peers.values() if p.control_address == control_address})
