"""Findings 1, 2, 6 and 8 of the second security pass (issue 30), each attack performed on
loopback against a real PD stack (prefill + decode + sglang-router, Mooncake over TCP) started
the way a user would: `kvpipe launch`'s code with the token given as a flag. After each, both
servers are idle again (kvpipe/qa/leaks.py) and the stack still serves. One stack for the module.

1. the data plane on every interface: `ss -ltnp` of the servers' processes;
2. the client steering the decode's bootstrap fetch: captured headers, unsigned or endless
   answers, hosts outside --disaggregation-bootstrap-allow, bogus hosts (counted, not timed);
6. no token on a non-loopback data plane;
8. the token in the children's command lines; a captured header replayed after a restart.
The fetch workers against bogus hosts in one process: test_bootstrap_fetch_guard.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvpipe.qa.leaks import wait_idle
from kvpipe.transfer.control.auth import HTTP_HEADER, REPLY_HEADER, TOKEN_ENV, Authenticator, http_context
from kvpipe.transfer.control.bootstrap import (
    BootstrapError,
    BootstrapServer,
    fetch_prefill_info,
    register_prefill_rank,
)
from tests.helpers.bootstrap_info import rank_info
from tests.helpers.pd_stack import Stack, disagg_stats, generate, greedy, pd_body, start_stack, wait_for

pytest.importorskip("mooncake.engine")

TOKEN = "the-stack-token-given-as-a-flag"
# the decode's allow list: TEST-NET-1, and loopback (where the stack runs), which an allow list
# must name like any other network (issue 45)
ALLOWED = "192.0.2.0/24,127.0.0.0/8"
FLAGS = (
    "--page-size",
    "16",
    "--max-total-tokens",
    "8192",
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "10",
    "--disaggregation-transfer-timeout",
    "3",
)
WILDCARDS = ("0.0.0.0", "*", "::")
MOONCAKE_WILDCARD = (
    "Mooncake Transfer Engine (0.3.13) binds its P2P handshake port to INADDR_ANY "
    "(findAvailableTcpPort in transfer_metadata_plugin.cpp) and its TCP data port to tcp::v6() "
    "dual-stack (TcpContext in tcp_transport_session_impl.h); no MC_* setting changes either "
    "(docs/security.md)"
)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-security"),
        *FLAGS,
        "--disaggregation-auth-token",  # finding 8: what a user types; launch must keep it off argv
        TOKEN,
        decode_args=("--disaggregation-bootstrap-allow", ALLOWED),
    )
    try:
        yield s
    finally:
        s.close()


def short(stack: Stack) -> dict:
    return generate(stack.router, {"input_ids": list(range(3, 40)), "sampling_params": greedy(4)})


def assert_idle(stack: Stack) -> None:
    idle = wait_idle({"prefill": stack.pd.prefill_url, "decode": stack.pd.decode_url}, timeout_s=30.0)
    assert idle.ok, [c for c in idle.checks if not c.ok]


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (TP workers, the tokenizer's helpers ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parents.items() if pp == p]
    return out


def listeners(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP listener of `pids`, from `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        if {int(p) for p in re.findall(r"pid=(\d+)", line)} & set(pids):
            host, _, port = line.split()[3].rpartition(":")
            found.append((host.strip("[]"), int(port)))
    return sorted(set(found))


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# ---- finding 1: the data plane on every interface ----------------------------------------------


def server_listeners(stack: Stack) -> dict[str, tuple[list[tuple[str, int]], set[int], int]]:
    """Per server: its processes' listeners, the ports kvpipe itself opens, Mooncake's RPC port."""
    out = {}
    for name, srv in (("prefill", stack.prefill), ("decode", stack.decode)):
        st = disagg_stats(srv)
        own = {_port(srv.url), _port(st["control_address"])}
        if name == "prefill":
            own.add(stack.pd.bootstrap_port)
        out[name] = (listeners(descendants(srv.proc.pid)), own, _port(st["data_address"]))
    return out


def test_finding1_kvpipe_listens_on_the_host_address_only(stack: Stack) -> None:
    """HTTP, bootstrap and ZMQ of a stack started with --host 127.0.0.1 listen on 127.0.0.1; what
    is left on a wildcard address is Mooncake's two ports per engine, nothing else."""
    for name, (found, own, mooncake_rpc) in server_listeners(stack).items():
        on_host = {port for host, port in found if host == "127.0.0.1"}
        wildcard = sorted(port for host, port in found if host in WILDCARDS)
        assert own <= on_host, (name, found)
        assert not own & set(wildcard), (name, found)
        assert {host for host, _ in found} <= {"127.0.0.1", *WILDCARDS}, (name, found)
        assert mooncake_rpc in wildcard and len(wildcard) == 2, (name, found)  # handshake + TCP data
    assert_idle(stack)


@pytest.mark.xfail(strict=True, reason=MOONCAKE_WILDCARD)
def test_finding1_mooncake_listens_on_the_data_plane_address(stack: Stack) -> None:
    for name, (found, _, _) in server_listeners(stack).items():
        assert not [x for x in found if x[0] in WILDCARDS], (name, found)


# ---- finding 2: where the decode fetches from, and what it accepts -----------------------------


def test_finding2_a_captured_header_is_refused_by_another_bootstrap_server(stack: Stack) -> None:
    insider = Authenticator.from_token(TOKEN)
    real = f"127.0.0.1:{stack.pd.bootstrap_port}"
    instance = httpx.get(f"http://{real}/health").json()["instance"]
    path = "/v1/prefill/ranks"
    with BootstrapServer("127.0.0.1", 0, auth=Authenticator.from_token(TOKEN)) as other:
        register_prefill_rank("127.0.0.1", other.port, rank_info(0), auth=insider)
        # a header captured on its way to the real server, raced to the other one with the same
        # Host header (or the right one): refused, the instance id differs
        for host in (real, f"127.0.0.1:{other.port}"):
            header = insider.sign_http(http_context("GET", real, path, instance), b"")
            r = httpx.get(f"{other.url}{path}", headers={HTTP_HEADER: header, "Host": host})
            assert r.status_code == 401 and "tag" in r.text, r.text
        assert other.auth_rejected == 2
        # the header as the decode sends it: accepted once by the server it names, answered with a
        # reply tag over that call
        header = insider.sign_http(http_context("GET", real, path, instance), b"")
        r = httpx.get(f"http://{real}{path}", headers={HTTP_HEADER: header})
        assert r.status_code == 200
        insider.verify_reply(http_context("GET", real, path, instance), header, r.content, r.headers[REPLY_HEADER])
        assert httpx.get(f"http://{real}{path}", headers={HTTP_HEADER: header}).status_code == 401  # replay
    assert short(stack)["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle(stack)


class _FakeBootstrap(BaseHTTPRequestHandler):
    """A bootstrap look-alike: /health names an instance; the look-up answers `mode`."""

    mode = "unsigned"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            body = b'{"status": "ok", "instance": "fake"}'
        elif self.mode == "unsigned":
            body = b'{"instance_id": "evil", "tp_size": 1, "model_name": "m", "ranks": []}'
        else:  # endless: more than any answer may hold
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b" " * (1 << 20))
            except OSError:
                return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_finding2_unsigned_and_endless_answers_are_refused() -> None:
    auth = Authenticator.from_token(TOKEN)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeBootstrap)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        _FakeBootstrap.mode = "unsigned"
        with pytest.raises(BootstrapError, match=REPLY_HEADER):
            fetch_prefill_info("127.0.0.1", srv.server_address[1], timeout_s=10.0, auth=auth)
        _FakeBootstrap.mode = "endless"
        with pytest.raises(BootstrapError, match="longer than"):
            fetch_prefill_info("127.0.0.1", srv.server_address[1], timeout_s=10.0, auth=auth)
    finally:
        srv.shutdown()
        srv.server_close()


def dead_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_finding2_the_client_cannot_steer_the_decode(stack: Stack) -> None:
    decode = stack.decode
    body = {"input_ids": list(range(3, 40)), "sampling_params": greedy(4)}
    fetches = disagg_stats(decode)["bootstrap_fetches"]
    # outside the allow list: refused before the request waits for pages, nothing fetched
    r = decode.post("/generate", json={**pd_body(stack, body), "bootstrap_host": "10.255.255.1"})
    assert r.status_code == 400 and "bootstrap-allow" in r.text, r.text
    assert disagg_stats(decode)["bootstrap_fetches"] == fetches
    # bogus hosts the list allows (loopback): one fetch each, then refused without a new one
    bogus = dead_ports(6)
    for port in bogus:  # (right after each other: the negative cache holds an address 10 s)
        out = decode.post("/generate", json={**pd_body(stack, body), "bootstrap_port": port}).json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and "unreachable" in str(out), out
        for _ in range(3):
            r = decode.post("/generate", json={**pd_body(stack, body), "bootstrap_port": port})
            assert r.status_code == 400 and "not tried again" in r.text, r.text
    assert disagg_stats(decode)["bootstrap_fetches"] == fetches + len(bogus)
    # the real prefill, proven, is not affected
    assert short(stack)["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle(stack)


def test_issue45_finding1_an_injected_bootstrap_host_is_a_400_and_connects_nowhere(stack: Stack) -> None:
    """The third pass: a bootstrap_host with a path in it made the decode GET another local
    service's URL, and that service's error body came back in the client's error."""
    decode = stack.decode
    body = {"input_ids": list(range(3, 40)), "sampling_params": greedy(4)}
    hits: list[str] = []

    class Service(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"local-secrets")

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    fetches = disagg_stats(decode)["bootstrap_fetches"]
    try:
        for host, bport in (
            (f"::ffff:127.0.0.1]:{port}/internal/admin?delete=1#", port),
            ("127.0.0.1/internal/admin", port),
            ("127.0.0.1", f"{port}/internal/admin"),
            ("127.1", port),
        ):
            r = decode.post("/generate", json={**pd_body(stack, body), "bootstrap_host": host, "bootstrap_port": bport})
            assert r.status_code == 400 and "bootstrap_" in r.text, r.text
        # a well-formed address of the service: one fetch (with a token it asks /health first, the
        # fixed path), and the service's body stays out of the client's error
        out = decode.post("/generate", json={**pd_body(stack, body), "bootstrap_port": port}).json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and "HTTP 404" in str(out), out
        assert "local-secrets" not in str(out)
        assert hits == ["/health"]
    finally:
        srv.shutdown()
        srv.server_close()
    assert disagg_stats(decode)["bootstrap_fetches"] == fetches + 1
    assert short(stack)["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle(stack)


# ---- finding 6: no token fails open -------------------------------------------------------------


def test_finding6_no_token_off_loopback_does_not_start(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    for mode in ("prefill", "decode"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpipe.cli",
                "serve",
                "--model-path",
                str(tiny_model_dir),
                "--disaggregation-mode",
                mode,
                "--disaggregation-host",
                "192.0.2.10",  # not loopback (and refused before anything binds to it)
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0
        assert "--disaggregation-insecure" in proc.stderr and "192.0.2.10" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


# ---- finding 8: the token in process lists; the replay window after a restart --------------------


def test_finding8_the_token_is_in_no_command_line(stack: Stack) -> None:
    pids = [p for proc in stack.pd.procs for p in descendants(proc.pid)]
    assert len(pids) >= 3
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read(), pid
    for srv in (stack.prefill, stack.decode):  # passed in the environment instead
        with open(f"/proc/{srv.proc.pid}/environ", "rb") as f:
            assert f"{TOKEN_ENV}={TOKEN}".encode() in f.read().split(b"\0")
        assert disagg_stats(srv)["authenticated"]


def test_finding8_a_captured_header_fails_after_a_restart_on_the_same_port(stack: Stack) -> None:
    insider = Authenticator.from_token(TOKEN)
    real = f"127.0.0.1:{stack.pd.bootstrap_port}"
    path = "/v1/prefill/ranks"
    instance = httpx.get(f"http://{real}/health").json()["instance"]
    header = insider.sign_http(http_context("GET", real, path, instance), b"")
    assert httpx.get(f"http://{real}{path}", headers={HTTP_HEADER: header}).status_code == 200
    os.killpg(stack.prefill.proc.pid, signal.SIGKILL)
    stack.prefill.proc.wait(10)
    stack.restart("prefill")  # same command, same ports, a fresh replay window
    assert httpx.get(f"http://{real}/health").json()["instance"] != instance
    r = httpx.get(f"http://{real}{path}", headers={HTTP_HEADER: header})
    assert r.status_code == 401 and "tag" in r.text, r.text
    assert disagg_stats(stack.prefill)["auth_rejected"]["bootstrap"] == 1
    # the stack serves again once the router trusts the restarted prefill
    wait_for(lambda: _serves(stack), 60, "the stack to serve again", interval_s=1.0)
    assert_idle(stack)


def _serves(stack: Stack) -> bool:
    try:
        return short(stack)["meta_info"]["finish_reason"]["type"] == "length"
    except (AssertionError, httpx.HTTPError):
        return False
