"""Link faults on the testbed (root, iproute2, nftables): loss drops its share of the packets both
ways, a partition stops a TCP stream that resumes on the same connection once healed, a flap
alternates, netem kinds run where the kernel has netem and are skipped by name where it has not.
Nothing is timed beyond generous liveness bounds."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from kvpipe.harness.link_faults import FaultKind, FaultRun, LinkFault, LinkFaults, netem_missing, nft_missing
from kvpipe.harness.testbed import LinkTestbed, can_run, tool

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not can_run(), reason="needs root and iproute2"),
    pytest.mark.skipif(nft_missing() is not None, reason=str(nft_missing())),
]


def _udp_through(tb: LinkTestbed, n: int, gap_s: float = 0.0) -> list[float]:
    """Send n datagrams from side b to side a; the receive times of those that arrived."""
    rx = tb.call_in("a", socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind((tb.addr_a, 0))
    rx.settimeout(1.0)
    got: list[float] = []

    def recv() -> None:
        while True:
            try:
                rx.recv(64)
            except TimeoutError:
                return
            got.append(time.monotonic())

    t = threading.Thread(target=recv, daemon=True)
    t.start()

    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for i in range(n):
                tx.sendto(i.to_bytes(4, "big"), (tb.addr_a, rx.getsockname()[1]))
                if gap_s:
                    time.sleep(gap_s)

    tb.call_in("b", send)
    t.join(30)
    rx.close()
    return got


def test_loss_drops_its_share(tmp_path) -> None:
    with LinkTestbed("100mbit", state_dir=tmp_path) as tb:
        faults = LinkFaults(tb.spec)
        faults.drop(20.0)
        got = len(_udp_through(tb, 2000, gap_s=0.0002))
        faults.heal()
        assert 1400 < got < 1800, got  # 80% of 2,000 (binomial sd ~18)
        assert len(_udp_through(tb, 500, gap_s=0.0002)) == 500  # healed: nothing lost
        faults.heal()  # idempotent


def test_partition_stops_tcp_which_resumes_on_the_same_connection(tmp_path) -> None:
    with LinkTestbed("100mbit", state_dir=tmp_path) as tb:
        srv = tb.call_in("a", socket.create_server, (tb.addr_a, 0))
        conn_box: list[socket.socket] = []
        t = threading.Thread(target=lambda: conn_box.append(srv.accept()[0]), daemon=True)
        t.start()
        c = tb.call_in("b", socket.create_connection, (tb.addr_a, srv.getsockname()[1]), 5)
        t.join(5)
        (conn,) = conn_box
        conn.settimeout(1.5)
        c.sendall(b"before")
        assert conn.recv(64) == b"before"
        with FaultRun(tb.spec, LinkFault.parse("partition:3s")) as run:
            time.sleep(0.3)
            assert run.applied_at is not None
            c.sendall(b"during")  # queued by the sender's TCP, retransmitted until the heal
            with pytest.raises(TimeoutError):
                conn.recv(64)
            assert run.wait_healed(30)
        conn.settimeout(30)  # retransmission back-off after a 3 s outage: well under this
        assert conn.recv(64) == b"during"
        assert run.healed_at is not None and run.healed_at - run.applied_at >= 3.0
        for s in (c, conn, srv):
            s.close()
        out = subprocess.run(
            [tool("ip"), "netns", "exec", tb.ns_a, tool("nft"), "list", "ruleset"], capture_output=True, text=True
        )
        assert "kvpipe_fault" not in out.stdout  # healed: our table is gone


def test_flap_alternates(tmp_path) -> None:
    with LinkTestbed("100mbit", state_dir=tmp_path) as tb:
        with FaultRun(tb.spec, LinkFault(FaultKind.FLAP, 2.4, down_s=0.4, up_s=0.4)) as run:
            got = _udp_through(tb, 600, gap_s=0.004)  # ~2.4 s of datagrams
            assert run.wait_healed(30)
        # some arrived (up phases) and some did not (down phases): at least 1/4 each way of 600
        assert 100 < len(got) < 500, len(got)


@pytest.mark.parametrize("kind", ["delay:30ms:2s", "jitter:30ms/10ms:2s", "reorder:25%/20ms:2s"])
def test_netem_kinds(tmp_path, kind: str) -> None:
    if (why := netem_missing()) is not None:
        pytest.skip(f"{kind.split(':')[0]}: {why}")
    with LinkTestbed("100mbit", state_dir=tmp_path) as tb:
        with FaultRun(tb.spec, LinkFault.parse(kind)) as run:
            time.sleep(0.2)
            assert len(_udp_through(tb, 200, gap_s=0.001)) == 200  # netem here delays, never drops
            assert run.wait_healed(30)
