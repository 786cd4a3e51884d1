"""A part's process: started in a session of its own (optionally pinned to cores), waited for until
its health URL answers, stopped with its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

import httpx


def command_line(args: str | bytes | os.PathLike | Sequence[str | bytes | os.PathLike]) -> str:
    """Popen.args as one line: a list is joined, a single program or shell string is kept whole."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return str(args)
    return " ".join(map(str, args))


def wait_healthy(url: str, timeout_s: float, procs: list[subprocess.Popen] | None = None) -> None:
    """Poll `url` until it answers 2xx; fail early if one of `procs` exited."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        for p in procs or []:
            if p.poll() is not None:
                raise RuntimeError(f"{command_line(p.args)!r} exited with {p.returncode} while waiting for {url}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code < 300:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s ({last})")


def answers(url: str) -> bool:
    """Whether `url` answers 2xx right now (one try, one second)."""
    try:
        return httpx.get(url, timeout=1.0).status_code < 300
    except httpx.HTTPError:
        return False


def stop_process(p: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; the process group goes too (TP workers)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)


@contextlib.contextmanager
def _affinity(cores: tuple[int, ...] | None) -> Iterator[None]:
    """The calling thread runs on `cores` meanwhile: a child forked now inherits them (Linux
    affinity is per thread), with no code run between fork and exec (no preexec_fn)."""
    if not cores or not hasattr(os, "sched_setaffinity"):  # not Linux: no pinning
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def spawn(
    cmd: list[str], log_path: str | None, pin: tuple[int, ...] | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `cmd` with its output appended to `log_path` (else ours), on the cores `pin`, with `env`
    on top of our environment."""
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child gets its own copy
    try:
        # A new session per child: Ctrl-C reaches only us, and we stop children in order.
        with _affinity(pin):
            return subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                env={**os.environ, **env} if env else None,
            )
    finally:
        if out is not None:
            out.close()  # else every restart would leak a descriptor in the launcher
