"""The two-process harness of `kvpipe bench transfer`: starts a decode and a prefill process
(spawned: fresh, single-threaded children), joined by a pipe of typed messages
(messages.py), and collects the prefill's report.

Each process first sends its stderr to its log file (Mooncake logs a lot) and enters its network
namespace, before its body makes any engine: Mooncake is imported when the first engine is made,
so every thread it starts lives in the right namespace. The prefill body returns the report;
whatever happens, the prefill then tells the decode to quit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

from kvpipe.bench.transfer.messages import Failed, Message, ProtocolError, Quit, Report
from kvpipe.harness.testbed import enter_netns

M = TypeVar("M")


class ProcessConfig(Protocol):
    @property
    def log_path(self) -> str: ...

    @property
    def netns(self) -> str | None: ...


C = TypeVar("C", bound=ProcessConfig)


class Peer:
    """The other process, at the far end of the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, msg: Message) -> None:
        self.conn.send(msg)

    def recv(self) -> Message:
        msg: Message = self.conn.recv()
        return msg

    def expect(self, kind: type[M]) -> M:
        msg = self.conn.recv()
        if not isinstance(msg, kind):
            raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
        return msg

    def ask(self, msg: Message, reply: type[M]) -> M:
        self.send(msg)
        return self.expect(reply)


class HarnessError(RuntimeError):
    """The prefill reported a failure, died or ran out of time (the message has both logs' tails)."""


def _enter(cfg: ProcessConfig) -> None:
    fd = os.open(cfg.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    if cfg.netns:
        enter_netns(cfg.netns)


def _decode_process(body: Callable[[C, Peer], None], cfg: C, conn: Connection) -> None:
    _enter(cfg)
    body(cfg, Peer(conn))


def _prefill_process(body: Callable[[C, Peer], dict[str, Any]], cfg: C, conn: Connection, parent: Connection) -> None:
    peer = Peer(conn)
    try:
        _enter(cfg)
        parent.send(Report(body(cfg, peer)))
    except BaseException as e:  # report, then let the process die
        parent.send(Failed(f"{type(e).__name__}: {e}"))
        raise
    finally:
        peer.send(Quit())


def run_pair(
    decode_body: Callable[[C, Peer], None],
    prefill_body: Callable[[C, Peer], dict[str, Any]],
    decode_cfg: C,
    prefill_cfg: C,
    timeout_s: float,
) -> dict[str, Any]:
    """Run both bodies in their own processes; the prefill's report, or HarnessError."""
    ctx = mp.get_context("spawn")  # fresh single-threaded children: safe to enter a netns
    p_peer, d_peer = ctx.Pipe()
    from_prefill, to_parent = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_decode_process, args=(decode_body, decode_cfg, d_peer), name="bench-decode", daemon=True),
        ctx.Process(
            target=_prefill_process,
            args=(prefill_body, prefill_cfg, p_peer, to_parent),
            name="bench-prefill",
            daemon=True,
        ),
    ]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not from_prefill.poll(0.2):
            if time.monotonic() > deadline or not procs[1].is_alive():
                break
        msg = from_prefill.recv() if from_prefill.poll(0) else Failed("prefill process died or timed out")
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
    if isinstance(msg, Report):
        return msg.result
    tails = {"prefill": _tail(prefill_cfg.log_path), "decode": _tail(decode_cfg.log_path)}
    why = msg.error if isinstance(msg, Failed) else f"unexpected report {type(msg).__name__}"
    raise HarnessError(
        f"transfer benchmark failed: {why}\n" + "\n".join(f"--- {n}.log ---\n{t}" for n, t in tails.items())
    )


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"
