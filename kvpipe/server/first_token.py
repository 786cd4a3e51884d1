"""Which engine outputs carry a request's first token, so the engine thread can hand them to the
event-loop thread before it starts its next forward.

Why: the engine thread posts a step's outputs to the event loop (call_soon_threadsafe) and goes
straight on to the next forward. The loop thread, asleep in epoll, must then be scheduled on a
core that forward keeps busy; traced at concurrency 1 on 2 loaded cores that wake-up took 3-5 ms
(post -> dispatch), every one of them on a request's TTFT, in the colocated server and in the PD
decode alike. Later tokens are not waited for: their gaps are the forwards themselves, and a
wait per step would cost throughput at high concurrency.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpipe.engine.request import TokenOutput

# How long the engine thread waits for the loop to take a first token; it waits only on steps that
# carry one, and a loop busier than this leaves it to the loop's own pace (the old behaviour).
FIRST_TOKEN_HANDOFF_S = 0.002


class FirstTokens:
    """Engine-thread bookkeeping of the requests that already produced output."""

    def __init__(self) -> None:
        self._started: set[str] = set()

    def any_first(self, outs: Iterable[TokenOutput]) -> bool:
        """True when one of `outs` carries a request's first token(s); forgets finished requests."""
        first = False
        for out in outs:
            if out.token_ids and out.rid not in self._started:
                first = True
                self._started.add(out.rid)
            if out.finish_reason is not None:
                self._started.discard(out.rid)
        return first

    def reset(self) -> None:
        """The engine failed its requests: none of them will report a finish."""
        self._started.clear()

    def __len__(self) -> int:
        return len(self._started)
