"""PeerLink: per-peer progress, rate, budget and piece size from completions alone (pure)."""

from __future__ import annotations

from kvpipe.transfer.backends.peer_link import INITIAL_PIECE, MIN_BUDGET, MIN_PIECE, SAMPLE_S, PeerLink


def test_progress_is_per_peer_not_per_piece() -> None:
    link = PeerLink()
    assert link.stalled_for(100.0) == 0.0  # nothing in flight: never stalled
    for _ in range(8):
        link.issued(1 << 20, 0.0)
    assert link.stalled_for(20.0) == 20.0
    link.ended(1 << 20, 20.0)  # one piece completed: every piece to this peer made progress
    assert link.stalled_for(25.0) == 5.0
    link.ended(1 << 20, 26.0, ok=False)  # a failed piece: the peer still answered
    assert link.stalled_for(26.0) == 0.0 and link.inflight_pieces == 6
    link.forget_inflight()
    assert (link.inflight_pieces, link.inflight_bytes, link.stalled_for(99.0)) == (0, 0, 0.0)


def test_slow_link_gets_small_pieces_and_a_small_budget() -> None:
    link = PeerLink()
    assert link.piece_bytes(4 << 20) == INITIAL_PIECE and link.budget() == MIN_BUDGET
    for _ in range(4):
        link.issued(INITIAL_PIECE, 0.0)
    for k in range(1, 5):  # 1 MB/s: one 256 KiB piece every 0.26 s
        link.ended(INITIAL_PIECE, k * INITIAL_PIECE / 1e6)
    assert link.rate is not None and abs(link.rate - 1e6) < 1
    assert link.piece_bytes(4 << 20) == 250_000  # a quarter second of the link
    assert link.budget() == MIN_BUDGET  # 2 s of 1 MB/s is below the floor
    assert link.may_issue(MIN_BUDGET) and link.piece_bytes(1500) == 1500  # the caller's cap wins
    link.issued(MIN_BUDGET, 2.0)
    assert not link.may_issue(1)  # budget full: admission holds the rest back
    slower = PeerLink(rate=1000.0)
    assert slower.piece_bytes(4 << 20) == MIN_PIECE


def test_short_busy_periods_only_raise_the_estimate() -> None:
    link = PeerLink(rate=5e8)
    link.issued(4096, 0.0)
    link.ended(4096, 0.001)  # 4 MB/s over 1 ms: latency, not the link
    assert link.rate == 5e8
    link.issued(1 << 30, 1.0)
    link.ended(1 << 30, 1.0 + SAMPLE_S)  # a long period measures the link, up or down
    assert abs(link.rate - (1 << 30) / SAMPLE_S) < 1
    fast = PeerLink()
    fast.issued(4 << 20, 0.0)
    fast.ended(4 << 20, 0.002)  # unmeasured: any sample counts
    assert fast.budget() > MIN_BUDGET and fast.piece_bytes(4 << 20) == 4 << 20
    assert "pieces" in fast.describe() and "Mbit/s" in fast.describe()
