"""Issue 45, finding 7, on the bootstrap server: a bounded slowloris run (300 sockets, each sending
one header byte a second and reconnecting when the server drops it) against a bootstrap server
in its own process (tests/helpers/bootstrap_victim.py) whose open descriptors the test counts in
/proc. The server holds at most its connection cap, a genuine look-up is served during the run
and after it, and once the attackers stop sending (their sockets still open) the server's
descriptors are back where they started. Counted, not timed: deadlines are generous bounds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpipe.transfer.control.bootstrap import BootstrapError, fetch_prefill_info
from tests.helpers.kv_transfer import wait_for

ROOT = Path(__file__).resolve().parents[2]
SOCKETS, ROUNDS = 300, 8  # the attack: sockets, and one header byte per socket per round (1 s)
CAP, READ_S = 64, 2.0  # the victim's connection cap and request read deadline
HEADER = b"GET /v1/prefill/ranks HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 4096


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Slowloris:
    """SOCKETS connections, each sending the next byte of HEADER on every `tick`; a socket the
    server closed is opened again (the attack keeps its pressure), counted in `reopened`."""

    def __init__(self, port: int) -> None:
        self.port, self.reopened = port, 0
        self.socks: list[tuple[socket.socket, int]] = [(self._open(), 0) for _ in range(SOCKETS)]

    def _open(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        return s

    def tick(self) -> None:
        for i, (s, sent) in enumerate(self.socks):
            try:
                s.send(HEADER[sent : sent + 1])
                self.socks[i] = (s, sent + 1)
            except OSError:  # dropped by the server (408, or 503 past its cap): come back
                s.close()
                self.socks[i] = (self._open(), 0)
                self.reopened += 1

    def close(self) -> None:
        for s, _ in self.socks:
            s.close()


def served(port: int) -> bool:
    try:
        return fetch_prefill_info("127.0.0.1", port, timeout_s=2.0).instance_id == "inst-a"
    except BootstrapError:  # 503 past the cap, or a dropped connection: try again
        return False


@pytest.fixture
def victim():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.bootstrap_victim", str(CAP), str(READ_S)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_finding7_a_slowloris_run_holds_at_most_the_cap_and_leaves_nothing(victim: dict) -> None:
    port, pid = victim["port"], victim["pid"]
    assert served(port)
    time.sleep(0.5)  # the look-up's connection is closed on both sides
    baseline = fds(pid)
    attack = Slowloris(port)
    try:
        peak, genuine = 0, 0
        for _ in range(ROUNDS):
            attack.tick()  # a burst of reconnections: past the cap each is closed at once
            time.sleep(0.5)
            peak = max(peak, fds(pid) - baseline)
            genuine += served(port)  # between the attack's rounds
            time.sleep(0.5)
        # the server held at most its cap (and a few connections it was closing), dropped the
        # attackers past the cap and after the read deadline, and still served a genuine look-up
        assert peak <= CAP + 8, peak
        assert attack.reopened >= SOCKETS, attack.reopened
        # a genuine client takes the place of the slowest attacker (http_listener.py): served in
        # every round, but a round may lose its one try to a burst that took every slot first
        assert genuine >= ROUNDS - 2, genuine
        # the attackers stop sending and keep their sockets open: the server lets go of every one
        wait_for(lambda: fds(pid) <= baseline, 4 * READ_S + 10, "the server's descriptors back at the baseline")
        assert served(port)
    finally:
        attack.close()
    time.sleep(0.5)
    assert fds(pid) <= baseline
