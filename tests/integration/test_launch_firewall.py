"""`kvpipe launch --firewall` (issue 45, finding 10: a bare Mooncake client read all 8 KV buffers
of a prefill and wrote into one), in network namespaces this test creates and removes, also on
failure: the stack runs in namespace A; B (10.99.0.2, on A's 10.99.0.1) is a peer let in with
`--firewall-allow`; C (10.98.0.2, on A's 10.98.0.1) is anyone else.

- C's connections to every port the servers list in /server_info's `listeners` but HTTP (both
  Mooncake ports of each server, the bootstrap and control ports) are refused (TCP reset), while
  it reaches the router's HTTP port (so the refusal is the firewall's, not the routing's);
- B connects to the Mooncake ports, and the stack's own parts transfer KV (a request through the
  router is answered);
- the table goes at stop; a table whose launcher was killed goes at the next `--firewall` start.
Needs root, iproute2 and nftables (or iptables); skipped by name otherwise."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpipe.harness.testbed import kill_namespace_pids, run_in_netns, tool
from kvpipe.launch.firewall import FirewallSpec, backend, run_command, stack_tables
from kvpipe.server.client_keys import RUN_DIR_ENV, alive, read_keys_file

pytest.importorskip("mooncake.engine")
pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="firewall: needs root (network namespaces, nftables)"),
    pytest.mark.skipif(backend() is None, reason="firewall: needs nftables (nft) or iptables"),
]

ROOT = Path(__file__).resolve().parents[2]
A_PEER, B, A_OUT, C = "10.99.0.1", "10.99.0.2", "10.98.0.1", "10.98.0.2"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=30)
    assert not check or r.returncode == 0, (cmd, r.stderr)
    return r


@dataclass
class Netns:
    a: str
    b: str
    c: str

    def run(self, ns: str) -> Any:
        """A firewall command runner inside `ns`."""
        return lambda argv, stdin: run_command(["ip", "netns", "exec", ns, *argv], stdin)


@pytest.fixture(scope="module")
def netns() -> Iterator[Netns]:
    tag = f"kvfw{os.getpid()}{secrets.token_hex(2)}"
    n = Netns(f"{tag}-a", f"{tag}-b", f"{tag}-c")
    try:
        for ns in (n.a, n.b, n.c):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for peer, dev, (mine, theirs) in ((n.b, "b", (A_PEER, B)), (n.c, "c", (A_OUT, C))):
            sh("ip", "link", "add", f"{tag}{dev}0", "netns", n.a, "type", "veth", "peer", "name", f"{tag}{dev}1",
               "netns", peer)  # fmt: skip
            for ns, end, addr in ((n.a, f"{tag}{dev}0", mine), (peer, f"{tag}{dev}1", theirs)):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", end)
                sh("ip", "-n", ns, "link", "set", end, "up")
        yield n
    finally:
        for ns in (n.a, n.b, n.c):
            if (Path("/var/run/netns") / ns).exists():
                kill_namespace_pids(ns)
                sh("ip", "netns", "del", ns, check=False)


def connects(ns: str, host: str, port: int) -> bool:
    """Whether a TCP connection from namespace `ns` is accepted (False: refused)."""

    def attempt() -> bool:
        try:
            with socket.create_connection((host, port), timeout=10):
                return True
        except ConnectionRefusedError:
            return False

    return run_in_netns(ns, attempt)


@dataclass
class Launched:
    proc: subprocess.Popen
    text: str
    router: str
    keys: Any


@pytest.fixture(scope="module")
def launched(netns: Netns, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    tmp = tmp_path_factory.mktemp("firewall")
    port = 18000 + os.getpid() % 1000  # inside A: nothing else binds there
    cmd = ["ip", "netns", "exec", netns.a, sys.executable, "-m", "kvpipe.cli", "launch", "--firewall"]
    cmd += ["--firewall-allow", f"{B}/32", "--host", A_OUT, "--port", str(port), "--model-path", str(tiny_model_dir)]
    cmd += ["--log-dir", str(tmp / "logs"), "--timeout", "240", "--page-size", "16", "--max-total-tokens", "4096"]
    env = {**os.environ, RUN_DIR_ENV: str(tmp / "run"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvpipe PD stack ready"):
                break
        text = "".join(lines)
        assert "kvpipe PD stack ready" in text, text[-3000:]
        m = re.search(r"HTTP API keys: .* in (\S+) \(mode 0600", text)
        assert m, text
        yield Launched(proc, text, f"http://{A_OUT}:{port}", read_keys_file(Path(m.group(1))))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _server_info(netns: Netns, url: str, admin: str) -> dict[str, Any]:
    get = httpx.get
    r = run_in_netns(netns.a, get, url + "/server_info", headers={"Authorization": f"Bearer {admin}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_outsiders_are_refused_at_every_peer_port_and_peers_get_in(netns: Netns, launched: Launched) -> None:
    keys = launched.keys.keys
    assert re.search(r"firewall \((nft|iptables) kvpipe_\d+_\d+\): ports .* accept connections only", launched.text)
    servers = [u for u in launched.keys.urls if u != launched.router]
    tables: list[Sequence[dict[str, Any]]] = [_server_info(netns, u, keys.admin)["listeners"] for u in servers]
    names = {row["name"] for table in tables for row in table}
    assert {"http", "bootstrap", "control", "mooncake_handshake", "mooncake_data"} <= names, tables
    router_port = int(launched.router.rsplit(":", 1)[1])
    assert connects(netns.c, A_OUT, router_port)  # C reaches A: the refusals below are the firewall's
    peer_ports = [row["port"] for table in tables for row in table if row["name"] != "http"]
    assert peer_ports and not any(connects(netns.c, A_OUT, p) for p in peer_ports), peer_ports
    mooncake = [row["port"] for table in tables for row in table if row["name"].startswith("mooncake")]
    assert len(mooncake) == 4 and all(connects(netns.b, A_PEER, p) for p in mooncake)  # the allowed peer
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}}
    headers = {"Authorization": f"Bearer {keys.user}"}
    deadline = time.monotonic() + 60
    while True:  # the router admits its workers after its first health check
        r = run_in_netns(netns.a, httpx.post, launched.router + "/generate", json=body, headers=headers, timeout=120)
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text  # KV crossed


def test_the_table_goes_at_stop_and_a_killed_launcher_s_at_the_next_start(netns: Netns, launched: Launched) -> None:
    """Last in the module: it stops the stack."""
    kind, run = backend(), netns.run(netns.a)
    assert kind is not None and len(stack_tables(kind, run)) == 1
    launched.proc.send_signal(signal.SIGINT)
    assert launched.proc.wait(120) == 0
    assert stack_tables(kind, run) == []
    # a launcher killed with its table in place (a process that makes one, then kill -9)
    code = "from kvpipe.launch.firewall import FirewallSpec; from kvpipe.server.client_keys import alive; "
    code += "FirewallSpec().open(8000, alive).apply([12345]); print('made', flush=True); import time; time.sleep(300)"
    child = subprocess.Popen(
        ["ip", "netns", "exec", netns.a, sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "made"
    child.kill()
    child.wait()
    assert stack_tables(kind, run) == [f"kvpipe_{child.pid}_8000"]  # left behind
    fw = run_in_netns(netns.a, FirewallSpec().open, 9000, alive)  # what the next --firewall start does first
    assert stack_tables(kind, run) == [] and fw.applied is None
