"""Start a local PD stack: prefill servers, decode servers and sglang-router (PD mode), each
waited for until healthy; with the KV tier's flags, its mooncake_master first.

One prefill and one decode by default; `prefills=N, decodes=M` starts an xPyD stack (every
server on ports of its own, the prefills each with a bootstrap port, the router told about all of
them and routing with the given policies). Parts are named prefill, decode, router in a 1P1D
stack and prefill0.., decode0.., router otherwise.

Every process gets free loopback ports unless told otherwise, so two stacks can share a machine.
Prefill and decode get disjoint shares of the cores (core_split.py) instead of one torch thread
per core each, which oversubscribed the machine.

Secrets (secret_flags.py) go to the parts in their environment, never on a command line: the PD
token (the stack's own random one unless given) to the servers, and with `api_keys` a user and
an admin key (given, else random) to the servers and the router, whose control plane then needs
the admin key. Such a stack writes its keys file (server/client_keys.py: 0600, removed at close)
where kvpipe's clients find them by URL.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpipe.config import ConfigError
from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.launch.core_split import (
    CoreSplit,
    ServerCores,
    StackCores,
    server_cores,
    split_cores,
    split_cores_among,
    stack_server_cores,
)
from kvpipe.launch.firewall import MC_RANGE_ENV, FirewallSpec, mooncake_range
from kvpipe.launch.ports import StackPorts, bind_error, ports_taken
from kvpipe.launch.process import stop_process, wait_healthy
from kvpipe.launch.router import router_command_xpyd
from kvpipe.launch.secret_flags import StackArgs, StackSecrets, split_secrets
from kvpipe.launch.stack import PartSpec, PDStack, server_names
from kvpipe.launch.store_master import StoreMaster, wants_master
from kvpipe.server.client_keys import alive

logger = logging.getLogger(__name__)
# A part whose port another process bound between our pick and its bind exits at startup; it gets
# fresh ports and another start, up to this many starts.
START_TRIES = 3


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
    api_keys: bool = False,
    firewall: FirewallSpec | None = None,
) -> PDStack:
    """Start `prefills` prefill servers, `decodes` decode servers and sglang-router (PD mode) and
    wait until all are healthy.

    `split_cpus`: the servers get disjoint shares of this process's cores, as their --cpu-threads
    and their CPU affinity (core_split.py), except a server whose threads the caller's args already
    choose. The router runs on every core. `prefill_policy` / `decode_policy`: the router's.
    `api_keys`: the stack's HTTP API needs keys (the ones given, else fresh random ones).
    `firewall`: its peer ports accept only this host and the networks allowed (firewall.py; root)."""
    if prefills < 1 or decodes < 1:
        raise ConfigError(f"a PD stack needs at least one prefill and one decode, got {prefills}P{decodes}D")
    check_router_port(host, router_port)  # before any model loads
    # a secret given as a flag leaves the command lines (the children read it from their environment)
    args, secrets = split_secrets(server_args or [], prefill_args or [], decode_args or [], new_keys=api_keys)
    split, shares = _core_shares(split_cpus, prefills, decodes, args)
    ports, master_ports = StackPorts.pick(host, prefills, decodes, router_port, 3 if wants_master(args.server) else 0)
    master = StoreMaster(host, *master_ports) if master_ports else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    env: tuple[tuple[str, str], ...] = ()
    if firewall is not None:
        mc = mooncake_range(os.environ, host)
        env = tuple(zip(MC_RANGE_ENV, map(str, mc)))
    specs = StackSpecs(ports, model_path, args, shares, secrets, log_dir, master, env)
    stack = specs.new_stack(split, (prefill_policy, decode_policy))
    if firewall is not None:  # before any part binds a port
        stack.firewall = firewall.open(ports.router, alive)
        stack.firewall_fixed = (mc, *ports.bootstrap, *((master.rpc_port, master.metadata_port) if master else ()))
        stack.refresh_firewall()
    _start_parts(stack, specs, timeout_s)
    try:
        stack.refresh_firewall()  # the ports the servers bound: their control endpoints
        if secrets.api_key or secrets.admin_key:
            stack.publish_keys(secrets.keys)
    except BaseException:
        stack.close()
        raise
    return stack


def _core_shares(
    split_cpus: bool, prefills: int, decodes: int, args: StackArgs
) -> tuple[CoreSplit | StackCores | None, list[ServerCores]]:
    """How the servers share this process's cores (None: not split), and each server's share."""
    n = prefills + decodes
    if not split_cpus:
        return None, [ServerCores((), None)] * n
    if n == 2:
        pair = split_cores(affinity_cores())
        return pair, list(server_cores(pair, args.server, args.prefill, args.decode))
    split = split_cores_among(affinity_cores(), prefills, decodes)
    return split, stack_server_cores(split, args.server, [args.prefill] * prefills + [args.decode] * decodes)


def check_router_port(host: str, port: int | None) -> None:
    """ConfigError when the router's given port cannot be bound (in use, or the host is not ours): at
    once, not after the servers loaded their models. The ports the stack picks itself are free."""
    reason = bind_error(host, port) if port else None
    if reason is not None:
        raise ConfigError(f"the router's port {port} on {host} cannot be used: {reason}")


@dataclass
class StackSpecs:
    """Builds each part's PartSpec from the stack's current ports (again after fresh ones); the
    stack's URLs follow the ports."""

    ports: StackPorts
    model_path: str | None
    args: StackArgs
    shares: list[ServerCores]
    secrets: StackSecrets
    log_dir: str | None
    master: StoreMaster | None  # the KV tier's store, started first: its address goes to every server
    env: tuple[tuple[str, str], ...] = ()  # every server's, beside the secrets (--firewall: its Mooncake ports)
    stack: PDStack = field(init=False)

    @property
    def names(self) -> list[str]:
        return server_names(self.ports.prefills, len(self.ports.http) - self.ports.prefills)

    def url(self, port: int) -> str:
        return f"http://{self.ports.host}:{port}"

    def log(self, name: str) -> str | None:
        return os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None

    def new_stack(self, split: CoreSplit | StackCores | None, policies: tuple[str | None, str | None]) -> PDStack:
        """The stack with a spec for every part: the servers, the router, then the store if any."""
        p = self.ports
        self.stack = PDStack(
            self.url(p.http[0]), self.url(p.http[p.prefills]), self.url(p.router), p.bootstrap[0], split
        )
        self.stack.policies = policies
        self.stack.auth_token = self.secrets.token  # restarts reuse it, so survivors trust them
        self.stack.generated_keys = self.secrets.generated
        self.stack.specs += [self.server(i) for i in range(len(p.http))]
        self.stack.specs.append(self.router())
        if self.master is not None:  # last in the specs: the servers' indices stay what they were
            self.stack.specs.append(
                PartSpec("store", tuple(self.master.command()), self.master.health_url, self.log("store"))
            )
            self.stack.store_master = self.master
        return self.stack

    def server(self, i: int) -> PartSpec:
        """Server i's spec on http[i] (and bootstrap[i] for a prefill)."""
        p, name = self.ports, self.names[i]
        role: tuple[str, ...] = ("--disaggregation-mode", "decode")
        if i < p.prefills:
            role = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(p.bootstrap[i]))
        model = ("--model-path", self.model_path) if self.model_path else ()
        store = tuple(self.master.server_flags()) if self.master is not None else ()
        own = self.args.prefill if i < p.prefills else self.args.decode
        cmd = (sys.executable, "-m", "kvpipe.cli", "serve", "--host", p.host, *model, *self.args.server, *store)
        # its name in the stack last (over a --worker-name forwarded to every server): `kvpipe top`'s rows
        cmd = (*cmd, *self.shares[i].flags, "--port", str(p.http[i]), *role, *own, "--worker-name", name)
        urls = [self.url(port) for port in p.http]
        s = self.stack
        s.prefill_urls, s.decode_urls, s.bootstrap_ports = urls[: p.prefills], urls[p.prefills :], list(p.bootstrap)
        s.prefill_url, s.decode_url, s.bootstrap_port = urls[0], urls[p.prefills], p.bootstrap[0]
        return PartSpec(
            name, cmd, urls[i] + "/health", self.log(name), self.shares[i].pin, self.secrets.env() + self.env
        )

    def router(self) -> PartSpec:
        """The router's spec over the servers' current URLs."""
        p, s = self.ports, self.stack
        prefills = list(zip(s.prefill_urls, p.bootstrap))
        pp, dp = s.policies
        cmd = router_command_xpyd(prefills, s.decode_urls, p.host, p.router, p.metrics, pp, dp)
        s.router_url, s.router_metrics_url = self.url(p.router), self.url(p.metrics)
        return PartSpec(
            "router", tuple(cmd), s.router_url + "/health", self.log("router"), env=self.secrets.router_env()
        )

    def fresh(self, i: int) -> PartSpec:
        """Part i's spec on fresh ports (it lost one of its own to another process)."""
        self.ports.refresh(i)
        return self.router() if i == self.ports.router_part else self.server(i)


def _start_parts(stack: PDStack, specs: StackSpecs, timeout_s: float) -> None:
    """Start the store (if any), the servers, then the router, each waited for until healthy; on
    any failure every process started is stopped."""
    n = specs.ports.router_part
    store: list[subprocess.Popen] = []  # the master, until it joins stack.procs after the router
    starter = _PartStarter(stack, specs, timeout_s, store)
    try:
        if specs.master is not None:
            store.append(stack.specs[-1].spawn())
            wait_healthy(specs.master.health_url, timeout_s, store)
        for spec in stack.specs[:n]:
            stack.procs.append(spec.spawn())
        starter.wait(range(n))
        # The router once the servers answer: it checks its workers at startup, and its URLs of
        # them are final only now (a server that lost a port got fresh ones).
        stack.specs[n] = specs.router()
        stack.procs.append(stack.specs[n].spawn())
        starter.wait([n])
        stack.procs += store  # procs[i] runs specs[i]
        store.clear()
    except BaseException:
        stack.close()
        for p in store:
            stop_process(p)
        raise


@dataclass
class _PartStarter:
    """Waits for parts of a starting stack to answer /health. Their ports were free when picked,
    but the parts take seconds to start, in which another process on the machine may bind one; the
    part then exits ("Address already in use"). Such a part, and only such a one (its picked ports
    held by someone else once it exited), gets fresh ports and another start, up to START_TRIES."""

    stack: PDStack
    specs: StackSpecs
    timeout_s: float
    store: list[subprocess.Popen]
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

    def _restart_port_losers(self, parts: Sequence[int], error: RuntimeError) -> list[int]:
        """Restart the exited parts among `parts` that lost a port; raise `error` if one exited for
        another reason (or ran out of starts), or if another process exited."""
        ports = self.specs.ports
        exited = [j for j in parts if self.stack.procs[j].poll() is not None]
        if not exited:
            raise error  # another process exited (the store)
        if any(self.starts.get(j, 1) >= START_TRIES or not ports_taken(ports.host, ports.picked(j)) for j in exited):
            raise RuntimeError(
                "; ".join(
                    f"{self.stack.specs[j].name} exited with code {self.stack.procs[j].returncode} at startup"
                    for j in exited
                )
            ) from error
        for j in exited:
            self.starts[j] = self.starts.get(j, 1) + 1
            logger.warning(
                "%s exited at startup with a port taken; starting it on fresh ports", self.stack.specs[j].name
            )
            self.stack.specs[j] = self.specs.fresh(j)
            self.stack.procs[j] = self.stack.specs[j].spawn()
        return exited
