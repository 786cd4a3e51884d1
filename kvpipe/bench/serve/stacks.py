"""Server stacks the serving sweep starts, one per mode: mode -> context manager -> Endpoint.

inproc               one colocated `kvpipe serve` (zero-cost transfer reference), on loopback
baseline, pipelined  prefill + decode + sglang-router via `start_pd_stack`, with the mode's
                     server flags; on a LinkTestbed the prefill runs in namespace a and the
                     decode and router in namespace b, so the KV crosses the shaped link
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpipe.bench.serve.sweep import ModeFlags, colocated_flags, mode_server_flags
from kvpipe.harness.testbed import LinkTestbed, run_in_netns
from kvpipe.launch.ports import free_port
from kvpipe.launch.process import stop_process, wait_healthy
from kvpipe.launch.router import router_command
from kvpipe.launch.start import start_pd_stack
from kvpipe.transfer.control.auth import TOKEN_ENV, new_token

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    url: str  # where requests go: the router, or the colocated server
    info_url: str | None = None  # the server that reports its layer-group count (the prefill)
    netns: str | None = None  # the namespace `url` is reachable from (None: ours)
    servers: tuple[tuple[str, str], ...] = ()  # (name, url) of every kvpipe server behind `url`

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn with its sockets where `url` is reachable (a thread inside the namespace if needed)."""
        return run_in_netns(self.netns, fn, *args, **kwargs) if self.netns else fn(*args, **kwargs)


@dataclass(frozen=True)
class StackOptions:
    model_path: str | None = None  # None: the servers' default (SmolLM2-135M-Instruct)
    server_args: tuple[str, ...] = ()  # extra flags for every server
    log_dir: str | None = None  # server logs go here (else they are discarded)
    timeout_s: float = 300.0  # per part, to become healthy
    host: str = "127.0.0.1"


def _log(opts: StackOptions, name: str) -> Any:
    if not opts.log_dir:
        return subprocess.DEVNULL
    os.makedirs(opts.log_dir, exist_ok=True)
    return open(os.path.join(opts.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - closed by the caller


def _serve_cmd(opts: StackOptions, host: str, port: int, *flags: str) -> list[str]:
    model = ["--model-path", opts.model_path] if opts.model_path else []
    return [
        sys.executable,
        "-m",
        "kvpipe.cli",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        *model,
        *opts.server_args,
        *flags,
    ]


@contextlib.contextmanager
def colocated_server(opts: StackOptions, name: str = "inproc", flags: tuple[str, ...] = ()) -> Iterator[Endpoint]:
    port = free_port(opts.host)
    log = _log(opts, name)
    proc = subprocess.Popen(
        _serve_cmd(opts, opts.host, port, *flags), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    if log is not subprocess.DEVNULL:
        log.close()  # the child holds its own copy
    try:
        url = f"http://{opts.host}:{port}"
        wait_healthy(url + "/health", opts.timeout_s, [proc])
        yield Endpoint(url, url, servers=(("colocated", url),))
    finally:
        stop_process(proc)


@contextlib.contextmanager
def loopback_pd_stack(opts: StackOptions, flags: ModeFlags, name: str) -> Iterator[Endpoint]:
    log_dir = os.path.join(opts.log_dir, name) if opts.log_dir else None
    with start_pd_stack(
        opts.model_path,
        opts.host,
        server_args=[*opts.server_args, *flags.both],
        decode_args=list(flags.decode),
        log_dir=log_dir,
        timeout_s=opts.timeout_s,
    ) as stack:
        yield Endpoint(
            stack.router_url, stack.prefill_url, servers=(("prefill", stack.prefill_url), ("decode", stack.decode_url))
        )


@contextlib.contextmanager
def testbed_pd_stack(tb: LinkTestbed, opts: StackOptions, flags: ModeFlags, name: str) -> Iterator[Endpoint]:
    """Prefill on side a, decode and router on side b; every server binds its namespace's address."""
    a, b = tb.addr_a, tb.addr_b
    p_port, b_port = tb.call_in("a", free_port, a), tb.call_in("a", free_port, a)
    d_port, r_port = tb.call_in("b", free_port, b), tb.call_in("b", free_port, b)
    p_url, d_url, r_url = f"http://{a}:{p_port}", f"http://{b}:{d_port}", f"http://{b}:{r_port}"
    sub = StackOptions(opts.model_path, opts.server_args, os.path.join(opts.log_dir, name) if opts.log_dir else None)
    procs: list[subprocess.Popen] = []
    # the data plane is off loopback: the servers need a shared token (in their environment, as
    # `kvpipe launch` passes it), or they refuse to start
    env = {**os.environ, TOKEN_ENV: os.environ.get(TOKEN_ENV) or new_token()}

    def start(side: str, part: str, cmd: list[str]) -> None:
        log = _log(sub, part)
        procs.append(tb.popen(side, cmd, stdout=log, stderr=subprocess.STDOUT, env=env))  # type: ignore[arg-type]
        if log is not subprocess.DEVNULL:
            log.close()

    try:
        start(
            "a",
            "prefill",
            _serve_cmd(
                opts,
                a,
                p_port,
                *flags.both,
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(b_port),
            ),
        )
        start("b", "decode", _serve_cmd(opts, b, d_port, *flags.both, *flags.decode, "--disaggregation-mode", "decode"))
        for url in (p_url, d_url):
            tb.call_in("b", wait_healthy, url + "/health", opts.timeout_s, procs)
        start("b", "router", router_command(p_url, b_port, d_url, b, r_port, tb.call_in("b", free_port, b)))
        tb.call_in("b", wait_healthy, r_url + "/health", opts.timeout_s, procs)
        yield Endpoint(r_url, p_url, tb.ns_b, (("prefill", p_url), ("decode", d_url)))
    finally:
        for p in reversed(procs):
            stop_process(p)


def default_stack_factory(
    opts: StackOptions, testbed: LinkTestbed | None = None
) -> Callable[[str], contextlib.AbstractContextManager[Endpoint]]:
    """mode -> a context manager that starts that mode's stack and yields its Endpoint."""

    def open_stack(mode: str) -> contextlib.AbstractContextManager[Endpoint]:
        flags = mode_server_flags(mode)
        if flags is None:
            return colocated_server(opts, mode, colocated_flags(mode))
        if testbed is not None:
            return testbed_pd_stack(testbed, opts, flags, mode)
        return loopback_pd_stack(opts, flags, mode)

    return open_stack
