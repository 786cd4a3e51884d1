"""What a PD prefill tells about its transfers, through an observer instead of attributes of the
engine: the layer-group choice of every prefill batch and, per room whose KV landed, how long it
kept landing after the room's last forward (the transfer left exposed on the prefill side).

`TransferObserver` is the seam (the LayerPipeline calls every observer it was given);
`TransferCounters` is the observer every prefill keeps: plain counters that /server_info,
/metrics and the serving benchmark read (the benchmark takes deltas of the tail sums).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpipe.disagg.layer_groups import GroupChoice
from kvpipe.transfer.sender.stats import TransferTiming


class TransferObserver(Protocol):
    def on_layer_groups(self, tokens: int, choice: GroupChoice) -> None: ...
    def on_room_landed(self, timing: TransferTiming, tail_ms: float | None) -> None: ...


@dataclass
class TransferCounters:
    last: GroupChoice = field(default_factory=lambda: GroupChoice(1, "none"))
    batches_by_groups: Counter[int] = field(default_factory=Counter)  # prefill batches per group count
    reasons: Counter[str] = field(default_factory=Counter)  # ... per reason of the choice
    rooms_landed: int = 0
    bytes_landed: int = 0
    tail_ms_sum: float = 0.0  # over rooms whose last forward end is known
    tail_count: int = 0

    def on_layer_groups(self, tokens: int, choice: GroupChoice) -> None:
        self.last = choice
        self.batches_by_groups[choice.groups] += 1
        self.reasons[choice.reason] += 1

    def on_room_landed(self, timing: TransferTiming, tail_ms: float | None) -> None:
        self.rooms_landed += 1
        self.bytes_landed += timing.nbytes
        if tail_ms is not None:
            self.tail_ms_sum += max(0.0, tail_ms)
            self.tail_count += 1

    def snapshot(self) -> dict[str, Any]:
        """The keys /server_info carries (harness/probe.py reads num_groups and the tail sums)."""
        return {
            "num_groups": self.last.groups,
            "layer_groups_reason": self.last.reason,
            "layer_group_batches": dict(self.batches_by_groups),
            "transfer_tail_ms_sum": self.tail_ms_sum,
            "transfer_tail_count": self.tail_count,
        }
