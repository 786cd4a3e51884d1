"""What a decode's receiver counts (ReceiverBook.stats; /server_info and /metrics read it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReceiverStats:
    rejected_messages: int = 0
    bootstrap_fetches: int = 0
    registrations: int = 0  # RegisterPeer messages sent
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    auth_rejected: int = 0  # control frames the endpoint dropped (no valid tag, stale, replayed)
    foreign_rejected: int = 0  # statuses / aborts naming a session or sender the room was not requested from
    integrity_failed: int = 0  # rooms whose KV differed from the prefill's digest (kv_digest.py)
    # rooms failed because this decode refused their prefill's handshake, by reason (handshake.py labels)
    handshakes_refused: dict[str, int] = field(default_factory=dict)

    def count_refused(self, reason: str, rooms: int) -> None:
        self.handshakes_refused[reason] = self.handshakes_refused.get(reason, 0) + rooms
