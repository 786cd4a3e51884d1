"""A pretend cluster network: one network namespace per host (a pod, or the test's own "node"),
each with one address on a bridge that lives in a namespace of its own, so hosts reach each other
only across the bridge, as pods on separate machines do, and nothing touches the machine's own
network. Root and iproute2 (kvpipe/harness/testbed.py's tools and setns helpers).

    with NetnsCluster(["prefill-0", "decode-0", "node"]) as c:
        p = c.popen("prefill-0", argv, env, log)         # runs inside that namespace
        c.call("node", httpx.get, f"http://{c.addr['prefill-0']}:30000/health")

Namespaces are named kvk8s<pid>-<i>: a run that was SIGKILLed leaves its namespaces behind, and the
next run removes those whose owner pid is gone (`remove_stale`). close() (also at exit) stops the
processes, then deletes every namespace, which destroys the veths and the bridge with them.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvpipe.harness.testbed import (
    NETNS_RUN_DIR,
    _run,
    check_privileges,
    kill_namespace_pids,
    namespace_exists,
    run_in_netns,
    tool,
)
from kvpipe.launch.process import stop_process

T = TypeVar("T")
SUBNET = "10.98.0"  # inside our namespaces only: every run may use the same addresses
PREFIX = "kvk8s"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\w+)$")


def remove_stale() -> None:
    """Delete namespaces a killed earlier run left (its pid in their name, no longer alive)."""
    if not NETNS_RUN_DIR.is_dir():
        return
    for entry in NETNS_RUN_DIR.iterdir():
        m = _NAME.match(entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            kill_namespace_pids(entry.name, 2.0)
            _run(["ip", "netns", "del", entry.name], check=False)


class NetnsCluster:
    def __init__(self, hosts: Sequence[str]) -> None:
        if len(hosts) > 250 or len(set(hosts)) != len(hosts):
            raise ValueError(f"at most 250 distinct hosts, got {list(hosts)}")
        pid = os.getpid()
        self.switch = f"{PREFIX}{pid}-sw"
        self.ns = {h: f"{PREFIX}{pid}-{i}" for i, h in enumerate(hosts)}
        self.addr = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(hosts)}
        self._veth = {h: f"k8{pid % 10**6:06d}{i:02d}" for i, h in enumerate(hosts)}
        self._procs: list[subprocess.Popen] = []
        self._active = False

    def up(self) -> NetnsCluster:
        check_privileges()
        remove_stale()
        self._active = True
        atexit.register(self.close)
        try:
            _run(["ip", "netns", "add", self.switch])
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for host, ns in self.ns.items():
                a, b = self._veth[host] + "a", self._veth[host] + "b"
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", a, "netns", ns, "type", "veth", "peer", "name", b, "netns", self.switch])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", a])
                _run(["ip", "-n", ns, "link", "set", a, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", self.switch, "link", "set", b, "master", "br0"])
                _run(["ip", "-n", self.switch, "link", "set", b, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def popen(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start `argv` inside `host`'s namespace in a session of its own, its output in `log`."""
        with open(log, "ab") as out:
            p = subprocess.Popen(
                [tool("ip"), "netns", "exec", self.ns[host], *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._procs.append(p)
        return p

    def call(self, host: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) with the sockets it opens inside `host`'s namespace."""
        return run_in_netns(self.ns[host], fn, *args, **kwargs)

    def sockets(self, host: str) -> str:
        """`ss -tn` inside `host`'s namespace: its TCP connections."""
        return _run(["ip", "netns", "exec", self.ns[host], "ss", "-tn"]).stdout

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every process (SIGTERM, then SIGKILL), delete every namespace; idempotent."""
        if not self._active:
            return
        for p in reversed(self._procs):
            stop_process(p, timeout_s)
        self._procs.clear()
        for ns in [*self.ns.values(), self.switch]:
            if namespace_exists(ns):
                kill_namespace_pids(ns, 2.0)
                _run(["ip", "netns", "del", ns], check=False)
        self._active = False
        atexit.unregister(self.close)

    def __enter__(self) -> NetnsCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
