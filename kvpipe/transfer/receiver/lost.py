"""Prefills a decode dropped for silence, looked for again until found or forgotten (issue 50).

A prefill dropped for missed heartbeats (a partition, a stopped process) used to be fetched again only
when a request named it. Now its bootstrap server is asked again every `retry_s` (one attempt each,
on the receiver's own thread: receiver/kv_receiver.py): once it answers, the decode installs it and
registers at once, on fresh connections (book.py `_install`), so the prefill hears this decode again
(and gives it fresh connections: sender/revivals.py) before the first request after a heal, and the
readiness both report (`problem`) comes back without any traffic. A prefill not found within
`forget_s` is forgotten: a removed prefill (a rolling update gives its successor a new address)
does not keep a decode unready for longer than that. Plain bookkeeping under the book's lock.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from kvpipe.transfer.control.bootstrap_address import BootstrapAddress

MAX_LOST = 64  # prefill instances looked for at once (a decode pairs with a handful)


@dataclass
class LostPrefills:
    retry_s: float  # between two looks at one prefill
    forget_s: float  # looked for this long, then forgotten
    since: dict[BootstrapAddress, float] = field(default_factory=dict)  # when each was dropped
    next_try: dict[BootstrapAddress, float] = field(default_factory=dict)

    def lost(self, addr: BootstrapAddress, now: float) -> None:
        if addr in self.since or len(self.since) < MAX_LOST:
            self.since.setdefault(addr, now)
            self.next_try[addr] = now + self.retry_s  # the link just failed: not at once

    def found(self, addr: BootstrapAddress) -> None:
        self.since.pop(addr, None)
        self.next_try.pop(addr, None)

    def due(self, now: float, busy: Collection[BootstrapAddress]) -> list[BootstrapAddress]:
        """Prefills to look for now (`busy`: a fetch of it runs already); forgets the oldest."""
        for addr in [a for a, t in self.since.items() if now - t > self.forget_s]:
            self.found(addr)
        out = [a for a, t in self.next_try.items() if t <= now and a not in busy]
        for addr in out:
            self.next_try[addr] = now + self.retry_s
        return out

    def problem(self, now: float) -> str | None:
        """Why this decode cannot serve (when it knows no other prefill): the prefills it lost (no
        address: readiness answers on an open route; the log names them)."""
        if not self.since:
            return None
        first = min(self.since.values())
        return (
            f"no reachable prefill: {len(self.since)} prefill(s) dropped for missed heartbeats, the first "
            f"{now - first:.1f}s ago (looked for every {self.retry_s:g}s)"
        )
