"""A lost engine (a dead TP rank, kvpipe.engine.errors.EngineLost) is fatal at its first failed
step, where a plain step failure is retried: the server exits and a supervisor restarts it."""

from __future__ import annotations

import asyncio
import time

from kvpipe.engine.errors import EngineLost
from kvpipe.server.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine


class FailingEngine:
    """Steps as long as it is asked to (poll interval 0) and fails every one with `exc`."""

    def __init__(self, exc: Exception) -> None:
        self.exc, self.steps = exc, 0

    def set_wakeup(self, fn: object) -> None:
        pass

    def poll_interval(self) -> float:
        return 0.0 if self.steps < 20 else 0.05  # bounded: a few steps, then slow polling

    def step(self) -> list:
        self.steps += 1
        raise self.exc

    def shutdown(self) -> None:
        pass


def run_until_fatal(exc: Exception, timeout_s: float = 5.0) -> tuple[AsyncEngine, FailingEngine, list]:
    fatal: list[BaseException] = []
    eng = FailingEngine(exc)

    async def main() -> AsyncEngine:
        ae = AsyncEngine(lambda: eng, on_fatal=fatal.append)  # type: ignore[arg-type, return-value]
        ae.start()
        end = time.monotonic() + timeout_s
        while not fatal and time.monotonic() < end:
            await asyncio.sleep(0.01)
        await ae.stop(5.0)
        return ae

    return asyncio.run(main()), eng, fatal


def test_engine_lost_is_fatal_at_the_first_step() -> None:
    ae, eng, fatal = run_until_fatal(EngineLost("TP rank 1 is gone (exit code -9)"))
    assert eng.steps == 1 and isinstance(ae.fatal_error, EngineLost) and len(fatal) == 1


def test_a_plain_step_failure_is_retried_first() -> None:
    ae, eng, fatal = run_until_fatal(RuntimeError("one bad batch"))
    assert eng.steps == MAX_CONSECUTIVE_STEP_FAILURES and len(fatal) == 1
    assert not isinstance(ae.fatal_error, EngineLost)
