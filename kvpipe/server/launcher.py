"""`kvpipe launch`: a local PD stack — one prefill server, one decode server, sglang-router.

Every process gets free loopback ports unless told otherwise, so two stacks can share a machine.
Prefill and decode get disjoint shares of the cores (core_split.py) instead of one torch thread
per core each, which oversubscribed the machine.
Ctrl-C (or SIGTERM) stops the router first, then decode, then prefill, each with a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.server.core_split import CPU_THREADS_FLAG, CoreSplit, ServerCores, has_flag, server_cores, split_cores


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, procs: list[subprocess.Popen] | None = None) -> None:
    """Poll `url` until it answers 2xx; fail early if one of `procs` exited."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        for p in procs or []:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, p.args))!r} exited with {p.returncode} while waiting for {url}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code < 300:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s ({last})")


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


@dataclass
class PDStack:
    """Handles of a running local stack; `close()` stops everything in reverse order."""

    prefill_url: str
    decode_url: str
    router_url: str
    bootstrap_port: int
    cores: CoreSplit | None = None  # how the servers share the cores (None: not split)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def close(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        self.procs.clear()

    def __enter__(self) -> "PDStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def router_command(prefill_url: str, bootstrap_port: int, decode_url: str, host: str, port: int,
                   prometheus_port: int) -> list[str]:
    """sglang-router in PD mode. Its Prometheus exporter gets a port of its own (it defaults to a
    fixed one, so a second router on the machine would die at startup)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
            "--host", host, "--port", str(port), "--prometheus-host", host,
            "--prometheus-port", str(prometheus_port), "--log-level", "warn"]


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


def _spawn(cmd: list[str], log_path: str | None, pin: tuple[int, ...] | None = None) -> subprocess.Popen:
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
    # A new session per child: Ctrl-C reaches only us, and we stop children in order.
    with _affinity(pin):
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)


def start_pd_stack(model_path: str | None, host: str = "127.0.0.1", router_port: int | None = None,
                   server_args: list[str] | None = None, prefill_args: list[str] | None = None,
                   decode_args: list[str] | None = None, log_dir: str | None = None,
                   timeout_s: float = 300.0, split_cpus: bool = True) -> PDStack:
    """Start prefill, decode and sglang-router (PD mode) and wait until all are healthy.

    `split_cpus`: prefill and decode get disjoint shares of this process's cores, as their
    --cpu-threads and their CPU affinity (core_split.py), except a server whose threads the
    caller's args already choose. The router runs on every core."""
    py = sys.executable
    server_args, prefill_args, decode_args = server_args or [], prefill_args or [], decode_args or []
    split = split_cores(affinity_cores()) if split_cpus else None
    mine = ServerCores((), None)
    p_cores, d_cores = server_cores(split, server_args, prefill_args, decode_args) if split else (mine, mine)
    p_port, d_port, b_port = free_port(host), free_port(host), free_port(host)
    r_port = router_port or free_port(host)
    common = ["--host", host, *(["--model-path", model_path] if model_path else []), *server_args]
    log = (lambda name: os.path.join(log_dir, f"{name}.log")) if log_dir else (lambda name: None)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    stack = PDStack(f"http://{host}:{p_port}", f"http://{host}:{d_port}", f"http://{host}:{r_port}", b_port, split)
    try:
        stack.procs.append(_spawn([py, "-m", "kvpipe.cli", "serve", *common, *p_cores.flags, "--port", str(p_port),
                                   "--disaggregation-mode", "prefill",
                                   "--disaggregation-bootstrap-port", str(b_port), *prefill_args],
                                  log("prefill"), p_cores.pin))
        stack.procs.append(_spawn([py, "-m", "kvpipe.cli", "serve", *common, *d_cores.flags, "--port", str(d_port),
                                   "--disaggregation-mode", "decode", *decode_args], log("decode"), d_cores.pin))
        for url in (stack.prefill_url, stack.decode_url):
            wait_healthy(url + "/health", timeout_s, stack.procs)
        stack.procs.append(_spawn(router_command(stack.prefill_url, b_port, stack.decode_url, host, r_port,
                                                 free_port(host)), log("router")))
        wait_healthy(stack.router_url + "/health", timeout_s, stack.procs)
    except BaseException:
        stack.close()
        raise
    return stack


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="HF checkpoint directory (default: built-in tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="router port (the endpoint clients use)")
    p.add_argument("--log-dir", default=None, help="write each server's log here instead of the terminal")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each part to be healthy")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Entry point of `kvpipe launch`; `extra` flags go to both servers (e.g. --page-size 16)."""
    stack = start_pd_stack(args.model_path, args.host, args.port, server_args=extra,
                           log_dir=args.log_dir, timeout_s=args.timeout)
    stop = {"flag": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if has_flag(extra, CPU_THREADS_FLAG):
        print("kvpipe launch: both servers take the given --cpu-threads (no core split)", flush=True)
    elif stack.cores is not None:
        how = "each server pinned to its share" if stack.cores.disjoint else "one thread each"
        print(f"kvpipe launch: {stack.cores.describe()}; --cpu-threads its size, {how}", flush=True)
    print(f"kvpipe PD stack ready: router {stack.router_url} (prefill {stack.prefill_url}, "
          f"decode {stack.decode_url}, bootstrap port {stack.bootstrap_port})\n"
          f"try: curl -s {stack.router_url}/generate -H 'Content-Type: application/json' "
          f"-d '{{\"text\": \"Hello\", \"sampling_params\": {{\"max_new_tokens\": 16, \"temperature\": 0}}}}'\n"
          "Ctrl-C stops everything.", flush=True)
    try:
        while not stop["flag"]:
            dead = [p for p in stack.procs if p.poll() is not None]
            if dead:
                print(f"a part of the stack exited ({dead[0].args[:4]}...): shutting down", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        stack.close()
        print("kvpipe PD stack stopped.", flush=True)
