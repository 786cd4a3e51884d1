"""`Pulse`: the thread that sends a side's heartbeats, on its own clock (issue 50).

    pulse = Pulse(interval_s, beat, name="kvsender-0")   # beat(now): takes the lock, sends
    pulse.start(); ...; pulse.close()

Heartbeats used to leave from the transfer worker's pass, behind everything that pass does: a
backend submit that blocks (a Mooncake handshake with a peer across a partition), a staging
gather, the pass lock held by `pump()` on the engine's thread during such a call. A live rank then
went silent for as long as its slowest pass, and its peer declared it dead. This thread waits on
nothing but its own timer and the side's book lock (held only for bookkeeping, never across I/O
or compute), so a rank is heard while its process runs at all; a stopped or dead one is not.
It wakes four times per interval: the book sends at most one beat per interval, and a wake-up a
little early never turns into a beat a whole interval late.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Pulse:
    def __init__(
        self, interval_s: float, beat: Callable[[float], None], name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._period_s = interval_s / 4
        self._beat, self._clock = beat, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-pulse", daemon=True)

    def start(self) -> Pulse:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat(self._clock())
            except Exception:  # never let the pulse die: the peers would declare this side dead
                log.exception("%s failed to send heartbeats", self._thread.name)
            self._stop.wait(self._period_s)
