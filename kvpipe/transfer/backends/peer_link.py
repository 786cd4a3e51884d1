"""How the wire to one peer is doing, judged from the writes that complete on it (pure; the clock is
passed in). The Mooncake backend keeps one `PeerLink` per peer.

Slow is not stuck (issue 50). On an 8 Mbit/s link with 12 prompts' KV queued, a batch could wait
30 s behind the others while the link ran full, and a per-batch stall clock recreated the engine and
failed every room in flight. Here progress is per peer: any piece to the peer that completes is
progress for all of them, so only a peer whose pieces stopped completing is stuck. For that to hold
on a slow link, a piece must complete often: pieces are sized to a fraction of a second of the
link's measured rate (`piece_bytes`) and the bytes in flight to a peer are bounded to a couple of
seconds of it (`budget`: admission holds the rest back in the backend's own queue, where the stall
clock does not run and a cancel takes effect at once). A link moving at least MIN_PIECE bytes per
lane per stall timeout is never declared stuck.

The rate is bytes completed over the time the peer had writes in flight (its busy periods). A short
busy period mostly measures latency, not the link, so it may only raise the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

PIECE_S = 0.25  # a piece carries about this long of the link's measured rate
INFLIGHT_S = 2.0  # bytes in flight to a peer: about this long of its measured rate
MIN_PIECE = 64 << 10
INITIAL_PIECE = 4 << 20  # before the first measurement (the budget lets one out): 4 s at 8 Mbit/s
MIN_BUDGET = 4 << 20  # enough pieces in flight to keep every lane of a fast link busy while it is measured
SAMPLE_S = 0.1  # a busy period this long measures the link (shorter ones may only raise the estimate)


@dataclass
class PeerLink:
    """Writes in flight to one peer and how fast they complete."""

    inflight_bytes: int = 0
    inflight_pieces: int = 0
    last_progress: float = 0.0  # the last completion, or when the wire went busy from idle
    rate: float | None = None  # bytes/s, None until measured
    _busy_since: float | None = None
    _busy_bytes: int = 0

    def issued(self, nbytes: int, now: float) -> None:
        if self.inflight_pieces == 0:  # the stall clock and the busy period start with the wire
            self.last_progress = now
            self._busy_since, self._busy_bytes = now, 0
        self.inflight_bytes += nbytes
        self.inflight_pieces += 1

    def ended(self, nbytes: int, now: float, ok: bool = True) -> None:
        """A piece finished (or failed: the peer still answered). Either way it is progress."""
        self.inflight_bytes -= nbytes
        self.inflight_pieces -= 1
        self.last_progress = now
        if ok and self._busy_since is not None:
            self._busy_bytes += nbytes
            span = now - self._busy_since
            if span > 0:
                sample = self._busy_bytes / span
                if span >= SAMPLE_S or self.rate is None or sample > self.rate:
                    self.rate = sample
        if self.inflight_pieces == 0:
            self._busy_since = None

    def forget_inflight(self) -> None:
        """The engine holding the pieces in flight was thrown away."""
        self.inflight_bytes = self.inflight_pieces = 0
        self._busy_since = None

    def stalled_for(self, now: float) -> float:
        """Seconds without a completion while pieces are in flight (0 when none are)."""
        return 0.0 if self.inflight_pieces == 0 else now - self.last_progress

    def budget(self) -> int:
        """Bytes that may be in flight to this peer (one piece always may)."""
        if self.rate is None:
            return MIN_BUDGET
        return max(MIN_BUDGET, int(self.rate * INFLIGHT_S))

    def may_issue(self, nbytes: int) -> bool:
        return self.inflight_pieces == 0 or self.inflight_bytes + nbytes <= self.budget()

    def piece_bytes(self, max_op_bytes: int) -> int:
        """The longest piece to put on the wire to this peer now."""
        want = INITIAL_PIECE if self.rate is None else int(self.rate * PIECE_S)
        return max(1, min(max_op_bytes, max(MIN_PIECE, want)))

    def describe(self) -> str:
        rate = "not measured" if self.rate is None else f"{self.rate * 8 / 1e6:.3g} Mbit/s"
        return f"{self.inflight_pieces} pieces ({self.inflight_bytes} bytes) in flight, link measured at {rate}"
