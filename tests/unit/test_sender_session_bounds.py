"""A prefill rank's tombstones and orphans (transfer/sender/session_bounds.py): each decode session's
bound, oldest forgotten first, rooms our engine ran counted against no session, expiry."""

from __future__ import annotations

from kvpipe.transfer.sender.session_bounds import Orphans, Tombstones
from kvpipe.transfer.sender.stats import SenderStats


def test_a_session_past_its_bound_forgets_its_oldest_tombstone_only() -> None:
    stats = SenderStats()
    tombs = Tombstones(per_session=2, ttl_s=10.0, stats=stats)
    tombs.add(1, 0.0, "succeeded", set())  # a room our engine ran: no session's
    for room in (11, 12, 13):
        tombs.add(room, 0.0, "aborted", {"d/0"}, by="d/0")
    tombs.add(21, 0.0, "aborted", {"d/1"}, by="d/1")
    assert sorted(tombs) == [1, 12, 13, 21] and stats.tombstones_evicted == 1
    tombs.add(12, 1.0, "again", {"d/0"}, by="d/0")  # re-entombing moves it to the newest
    tombs.add(14, 1.0, "aborted", {"d/0"}, by="d/0")
    assert sorted(tombs) == [1, 12, 14, 21] and stats.tombstones_evicted == 2
    assert tombs.get(12) is not None and tombs.get(12).what == "again"  # type: ignore[union-attr]
    assert tombs.pop(12) is not None and tombs.get(12) is None and tombs.pop(12) is None


def test_tombstones_expire_after_their_ttl() -> None:
    tombs = Tombstones(per_session=8, ttl_s=5.0, stats=SenderStats())
    tombs.add(1, 0.0, "succeeded", set())
    tombs.add(2, 3.0, "aborted", {"d/0"}, by="d/0")
    tombs.expire(4.99)
    assert sorted(tombs) == [1, 2]
    tombs.expire(5.0)
    assert sorted(tombs) == [2] and [t.expires_at for t in tombs.values()] == [8.0]
    tombs.expire(8.0)
    assert len(tombs) == 0
    for room in range(8):  # the expired one no longer counts against d/0
        tombs.add(room, 9.0, "aborted", {"d/0"}, by="d/0")
    assert len(tombs) == 8


def test_orphans_count_per_session_until_adopted() -> None:
    orphans = Orphans()
    orphans.add("d/0", 7)
    orphans.add("d/0", 8)
    orphans.add("d/1", 7)
    assert (orphans.count("d/0"), orphans.count("d/1"), orphans.count("d/2")) == (2, 1, 0)
    orphans.adopt(7, ["d/0", "d/1", "d/2"])
    assert (orphans.count("d/0"), orphans.count("d/1"), len(orphans)) == (1, 0, 1)
    orphans.adopt(8, ["d/0"])
    assert len(orphans) == 0
