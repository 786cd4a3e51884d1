"""A running local PD stack: each part's spec (how to start it again), their processes, the
stack's URLs and layout, and its supervision.

Supervision: a part that exits (crash, OOM kill, kill -9) is started again with the same command
on the same ports, after a backoff, while the other parts keep serving; it counts as up once it
answers /health. The decode notices a restarted prefill (new instance id at bootstrap) and the
router trusts a worker again after its health checks. A part that keeps exiting past the policy's
bound (supervisor.py) stops the whole stack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpipe.engine.cpu_threads import affinity_cores, format_cores, plan_cpu_threads
from kvpipe.launch.core_split import CPU_THREADS_FLAG, CoreSplit, StackCores, flag_value
from kvpipe.launch.firewall import Firewall, FirewallError
from kvpipe.launch.process import answers, spawn, stop_process
from kvpipe.launch.store_master import StoreMaster
from kvpipe.launch.supervisor import PartState, RestartPolicy, Supervisor
from kvpipe.server.client_keys import StackKeys, keys_file_path, remove_stale_keys_files, write_keys_file
from kvpipe.server.listeners import listeners, process_tree

PARTS = ("prefill", "decode", "router")  # the order of PDStack.procs; stopped in reverse
SUPERVISE_TICK_S = 0.25
logger = logging.getLogger(__name__)


def server_names(prefills: int, decodes: int) -> list[str]:
    """prefill, decode in a 1P1D stack (the names every tool knew before xPyD); prefill0..,
    decode0.. otherwise."""
    if prefills == 1 and decodes == 1:
        return ["prefill", "decode"]
    return [f"prefill{i}" for i in range(prefills)] + [f"decode{i}" for i in range(decodes)]


def _int_flag(cmd: list[str], flag: str) -> int | None:
    value = flag_value(cmd, flag)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


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
        return spawn(list(self.cmd), self.log_path, self.pin, dict(self.env))


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
    keys: StackKeys = field(default_factory=StackKeys)  # the HTTP API's keys (none: open)
    generated_keys: tuple[str, ...] = ()  # which of them are fresh random ones ("user", "admin")
    keys_file: Path | None = None  # where they are for kvpipe's clients (removed at close)
    firewall: Firewall | None = None  # --firewall: the stack's table (removed at close)
    firewall_fixed: tuple[int | tuple[int, int], ...] = ()  # what it always protects (the Mooncake range, ...)

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
            names = server_names(prefills, len(self._server_urls()) - prefills)
        return names

    def proc(self, name: str) -> subprocess.Popen:
        names = [s.name for s in self.specs] or list(PARTS)
        return self.procs[names.index(name)]

    def workers(self) -> list[tuple[str, str, int | None]]:
        """(name, URL, bootstrap port or None) of every server, prefills first (spec order)."""
        prefill_urls = self.prefill_urls or [self.prefill_url]
        ports = self.bootstrap_ports or [self.bootstrap_port]
        urls = self._server_urls()
        return [
            (name, urls[i], ports[i] if i < len(prefill_urls) else None) for i, name in enumerate(self._server_names())
        ]

    def layout_lines(self) -> list[str]:
        """The stack's layout as `kvpipe launch` prints it at start: one line per worker, then the router."""
        workers = self.workers()
        prefills = sum(port is not None for _, _, port in workers)
        lines = [f"layout: {prefills}P{len(workers) - prefills}D"]
        for i, (name, url, port) in enumerate(workers):
            where = f"{url} (bootstrap port {port}, " if port is not None else f"{url} ("
            lines.append(f"  {name:<9} {where}{self.cores_text(i)})")
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

    def cores_text(self, i: int) -> str:
        """Server i's TP size, torch threads and cores as its process has them: "TP 1, 2 threads, cores
        0-1 (pinned)". The cores are its CPU affinity read from the running process (before it runs:
        the cores it is started on); the threads what it plans with them (engine/cpu_threads.py)."""
        if i >= len(self.specs):
            return "TP 1"
        spec = self.specs[i]
        cmd = list(spec.cmd)
        tp = _int_flag(cmd, "--tp-size") or 1
        cores = self._affinity(i)
        try:
            threads = plan_cpu_threads(_int_flag(cmd, CPU_THREADS_FLAG), tp, cores).total
        except ValueError:  # a bad --cpu-threads: the server refuses it and says so
            return f"TP {tp}, cores {format_cores(cores)}"
        pinned = "pinned" if spec.pin else "not pinned"
        return f"TP {tp}, {threads} thread{'s' if threads != 1 else ''}, cores {format_cores(cores)} ({pinned})"

    def _affinity(self, i: int) -> tuple[int, ...]:
        """Server i's CPU affinity: its process's now, else the cores it is started on."""
        if i < len(self.procs) and self.procs[i].poll() is None:
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or it just exited
                return tuple(sorted(os.sched_getaffinity(self.procs[i].pid)))
        return self.specs[i].pin or affinity_cores()

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
                if answers(spec.health_url):
                    log(part.healthy(time.monotonic()))
                    self._refresh_after_restart(log)
                elif part.start_timed_out(now):
                    log(f"{spec.name} not healthy {sup.policy.start_timeout_s:g} s after its restart: killing it")
                    stop_process(proc)  # the next tick counts this exit
        return True

    def publish_keys(self, keys: StackKeys) -> None:
        """Keep `keys` and write them to the stack's keys file (server/client_keys.py), where
        kvpipe's clients of any of its URLs find them; stale files of dead stacks go first."""
        self.keys = keys
        remove_stale_keys_files()
        path = keys_file_path(self.router_url)
        write_keys_file(path, keys, self.router_url, [self.router_url, *self._server_urls()], os.getpid())
        self.keys_file = path

    def refresh_firewall(self) -> None:
        """Protect the fixed ports and every port the servers listen on now but HTTP (firewall.py)."""
        if self.firewall is None:
            return
        live: list[int] = []
        for i, url in enumerate(self._server_urls()):
            if i < len(self.procs):
                http = int(url.rsplit(":", 1)[1])
                live += [lst.port for lst in listeners(process_tree(self.procs[i].pid)) if lst.port != http]
        self.firewall.apply([*self.firewall_fixed, *live])

    def _refresh_after_restart(self, log: Callable[[str], None]) -> None:
        try:
            self.refresh_firewall()  # a restarted server's new control endpoint
        except FirewallError as e:
            log(f"firewall not refreshed: {e}")

    def close(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        self.procs.clear()
        if self.firewall is not None:
            try:
                self.firewall.close()
            except FirewallError as e:  # the next --firewall start removes it (its launcher is gone)
                logger.warning("could not remove the firewall table %s: %s", self.firewall.name, e)
        if self.keys_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.keys_file.unlink()
            self.keys_file = None

    def __enter__(self) -> PDStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
