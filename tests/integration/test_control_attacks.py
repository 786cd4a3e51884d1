"""Issue 30, findings 3 and 5, performed on real ZMQ endpoints.

Finding 3: a 300 MiB forged frame (copied whole before authentication: 636 MB peak RSS) and a
signed msgpack bomb. The victim PD pair runs in its own process (tests/helpers/frame_victim.py),
whose peak RSS (VmHWM) is read before and after; the bound is a fraction of the frame, not a
timing. Finding 5: a token holder forges a TransferStatus(SUCCESS) for another session's room and
registers with another decode's data address; reply sockets stay bounded. Afterwards both sides'
books hold no room and the real transfer lands where it should."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.auth import TOKEN_ENV, Authenticator
from kvpipe.transfer.control.endpoint import ControlEndpoint
from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.kv_transfer import CFG, PAGES, SRC, Results, assert_moved, start_decode, start_prefill, wait_for

TOKEN = "correct-horse-battery-staple"
FRAME = 300 << 20  # the forged frame
ROOT = Path(__file__).resolve().parents[2]


def _peak_rss(pid: int) -> int:
    """VmHWM of a process, bytes: the most resident memory it ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc status")


def _send_until_dropped(ctx: zmq.Context, addr: str, frame: bytes | memoryview) -> None:
    """Send one frame and wait until the peer drops the connection (ZMQ_MAXMSGSIZE refuses it on its
    header), so the victim has seen it before its memory is read."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(addr)
        sock.send(frame, copy=False)
        assert monitor.poll(60_000), f"{addr} never dropped the oversized frame's connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def test_an_oversized_frame_and_a_signed_bomb_are_refused_before_they_cost_memory():
    env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.frame_victim"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        addrs = json.loads(proc.stdout.readline())

        def transfer() -> dict:
            proc.stdin.write("transfer\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        first = transfer()  # warm: the transfer path has run once before the baseline
        assert first["ok"]
        before = _peak_rss(proc.pid)
        frame = memoryview(bytearray(FRAME))  # zero pages: the sender side costs no RSS either
        for addr in (addrs["decode"], addrs["prefill"]):
            _send_until_dropped(ctx, addr, frame)
        grown = _peak_rss(proc.pid) - before
        assert grown < FRAME // 8, f"peak RSS grew {grown >> 20} MiB for a {FRAME >> 20} MiB frame"
        # a bomb that fits the prefill's frame bound, signed with the token: authenticated, then
        # refused by the decoding limits (no arrays at all) before it expands
        auth = Authenticator.from_token(TOKEN)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(addrs["prefill"])
        bomb = msgpack.packb({"kind": "heartbeat", "version": m.PROTOCOL_VERSION, "session_id": "s", "seq": [[]] * 400})
        push.send(auth.seal(bomb, addrs["prefill"].encode()))
        push.close()
        after = wait_for(lambda: (out := transfer())["malformed"] > first["malformed"] and out, 10, "the bomb refused")
        assert after["ok"] and after["sender_rooms"] == after["receiver_rooms"] == 0
        assert after["auth_rejected"] == first["auth_rejected"]  # refused by size, not by the tag
    finally:
        ctx.term()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_forged_status_and_a_foreign_registration_are_refused_and_the_real_transfer_lands(stack):
    cfg = dataclasses.replace(CFG, auth_token=TOKEN)
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, cfg=cfg)
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    sender = prefill.senders[0]
    replies: list[m.RegisterReply] = []
    insider = ControlEndpoint(
        "127.0.0.1",
        lambda msg: replies.append(msg) if isinstance(msg, m.RegisterReply) else None,
        name="insider",
        auth=Authenticator.from_token(TOKEN),
    )
    stack.callback(insider.close)
    insider.start()
    dst = np.arange(6) + 20
    recv.add_room(21, "127.0.0.1", prefill.port, dst)
    wait_for(lambda: sender.room_state(21) is TransferState.BOOTSTRAPPING, 5, "the request at the prefill")
    # the prefill's session is public to token holders (bootstrap); the decode's is guessed
    for session in (f"{recv.instance_id}/0", recv.sessions[0], "anything"):
        insider.send(
            recv.control_address,
            m.TransferStatus(21, session, m.WireState.SUCCESS, "", m.AuxData(21, 7, 0.0), sender.session_id),
        )
    victim = sender._book.peers.peers
    [(session, reg)] = victim.items()
    evil = m.RegisterPeer("evil/0", 0, 1, reg.data_address, insider.address, reg.layout)
    insider.send(sender.control_address, evil)
    # the insider receives at its address: it answers the challenge, and is refused for the clash
    [challenge] = wait_for(lambda: list(replies), 5, "the registration's challenge")
    assert challenge.state is m.RegisterState.CHALLENGE
    insider.send(sender.control_address, dataclasses.replace(evil, challenge=challenge.challenge))
    wait_for(lambda: recv.stats.foreign_rejected == 3, 5, "the forged statuses refused")
    wait_for(lambda: sender.stats.rejected_messages == 1, 5, "the foreign registration refused")
    refused = wait_for(lambda: replies[1:], 5, "the refusal at the insider's address")
    assert refused[0].state is m.RegisterState.REFUSED and "registered by the decode" in refused[0].reason
    assert recv.room_state(21) is TransferState.WAITING_FOR_INPUT and Results(recv).absent(21)
    assert list(victim) == [session]
    # the real prefill finishes the room: its KV lands where the decode asked, both books empty
    sender.add_room(21, SRC)
    sender.send(21, 0, 22, last=True, aux=(5, -0.1))
    assert Results(recv).get(21)[1:4:2] == (TransferState.SUCCESS, m.AuxData(21, 5, -0.1))
    assert Results(sender).get(21)[1] is TransferState.SUCCESS
    assert_moved(prefill, recv, SRC, dst, np.setdiff1d(np.arange(PAGES), dst))
    assert sender.num_rooms() == recv.num_rooms() == 0


@pytest.mark.parametrize("max_sockets", [4])
def test_reply_sockets_are_pooled_and_the_least_recently_used_closed(max_sockets):
    got: list[object] = []
    ep = ControlEndpoint("127.0.0.1", got.append, name="pool", max_sockets=max_sockets).start()
    peer = ControlEndpoint("127.0.0.1", got.append, name="peer").start()
    try:
        assert ep.send(peer.address, m.Heartbeat("a", 0))
        for port in range(20):  # a flood of reply addresses nobody listens on
            ep.send(f"tcp://127.0.0.1:{40000 + port}", m.Heartbeat("a", port))
            assert ep.num_sockets() <= max_sockets
        assert ep.stats.sockets_closed == 21 - max_sockets
        assert ep.send(peer.address, m.Heartbeat("a", 99))  # reopened on demand
        wait_for(lambda: m.Heartbeat("a", 99) in got, 5, "the peer reached again")
        assert ep.send("not an address", m.Heartbeat("a", 1)) is False  # refused, not raised
    finally:
        ep.close()
        peer.close()
