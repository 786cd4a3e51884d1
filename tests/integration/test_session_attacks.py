"""Issue 45, findings 3 and 6 (rooms), performed on loopback against a real prefill rank and a real
decode (bootstrap server, ZMQ, local backend) in one process, every peer holding the token.

3. Session exhaustion: fake decode endpoints (each listening, so each answers its challenge) fill a
   prefill rank started with a small --disaggregation-max-sessions; a registration in the genuine
   decode's name (its control address) never becomes a session; the genuine decode is served, also
   after the squatters registered again and evicted its idle session.
6. A rogue session that knows a room id but not the request: asking for the room before the real
   decode (before and after the prefill admitted it), aborting it, pre-aborting it; the victim's
   request is served every time and its KV lands in its pages only.
After each, both sides hold no room and the prefill rank no more sessions than its bounds."""

from __future__ import annotations

import dataclasses
import itertools
from contextlib import ExitStack

import numpy as np

from kvpipe.config import ControlLimits
from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.auth import Authenticator
from kvpipe.transfer.control.endpoint import ControlEndpoint
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.sender.kv_sender import KVSender
from tests.helpers.kv_transfer import (
    CFG,
    PAGES,
    SRC,
    Prefill,
    Results,
    RigReceiver,
    assert_moved,
    rank_pool,
    start_decode,
    start_prefill,
    wait_for,
)

TOKEN = "correct-horse-battery-staple"
PROMPT = list(range(100, 122))  # the victim's 22-token request
S, F = TransferState.SUCCESS, TransferState.FAILED
_ports = itertools.count(20000)


class TokenHolder:
    """A peer with the deployment token and an endpoint of its own: it registers decode sessions
    with a prefill rank (answering their challenges, since it receives at its address) and keeps
    every message the prefill sends it."""

    def __init__(self, stack: ExitStack, name: str) -> None:
        self.got: list[object] = []
        self.ep = ControlEndpoint("127.0.0.1", self._on, name=name, auth=Authenticator.from_token(TOKEN)).start()
        stack.callback(self.ep.close)
        self.regs: dict[str, m.RegisterPeer] = {}
        self.data = f"127.0.0.1:{next(_ports)}"  # nothing listens there: no write may go to it

    def _on(self, msg: object) -> None:
        self.got.append(msg)
        if isinstance(msg, m.RegisterReply) and msg.state is m.RegisterState.CHALLENGE and msg.session_id in self.regs:
            reg = dataclasses.replace(self.regs[msg.session_id], challenge=msg.challenge)
            self.ep.send(self.control_to, reg)

    def register(self, sender: KVSender, session: str, control_address: str | None = None) -> None:
        self.control_to = sender.control_address
        _, layout = rank_pool(1, 0, None)
        reg = m.RegisterPeer(session, 0, 1, self.data, control_address or self.ep.address, layout)
        self.regs[session] = reg
        self.ep.send(sender.control_address, reg)

    def replies(self, state: m.RegisterState) -> list[m.RegisterReply]:
        return [x for x in self.got if isinstance(x, m.RegisterReply) and x.state is state]

    def statuses(self, room: int) -> list[m.TransferStatus]:
        return [x for x in self.got if isinstance(x, m.TransferStatus) and x.room == room]


def transfer(prefill: Prefill, recv: RigReceiver, room: int, dst: np.ndarray) -> None:
    """The genuine request: both sides add the room with the prompt's claim, the prefill sends its
    KV; both report Success and the KV is in the decode's pages (dst: pages no other room of the
    test used; those after it are still zero)."""
    sender, claim = prefill.senders[0], m.room_claim(room, PROMPT)
    recv.add_room(room, "127.0.0.1", prefill.port, dst, claim=claim)
    sender.add_room(room, SRC, claim=claim)
    sender.send(room, 0, 22, last=True, aux=(5, -0.5))
    assert Results(recv).get(room)[1:] == (S, "", m.AuxData(room, 5, -0.5))
    assert Results(sender).get(room)[1] is S
    assert_moved(prefill, recv, SRC, dst, np.arange(dst.max() + 1, PAGES))


def test_finding3_squatters_cannot_lock_the_genuine_decode_out(stack: ExitStack) -> None:
    cfg = dataclasses.replace(CFG, auth_token=TOKEN, limits=ControlLimits(max_sessions=4))
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, cfg=cfg)
    sender = prefill.senders[0]
    peers = sender._book.peers
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    squatters = [TokenHolder(stack, f"squatter-{i}") for i in range(6)]
    for i, sq in enumerate(squatters):
        sq.register(sender, f"squat/{i}")
        wait_for(lambda sq=sq: sq.replies(m.RegisterState.ACCEPTED), 5, f"squatter {i} registered")
    assert len(peers.peers) == 4  # full: the two oldest squatters were evicted, and told so
    assert sum(len(sq.replies(m.RegisterState.EVICTED)) for sq in squatters) == 2
    # a registration in the genuine decode's name: the challenge goes to the decode, which knows
    # no such session, so it never becomes one
    squatters[0].register(sender, "in-its-name/0", control_address=recv.control_address)
    wait_for(lambda: recv.stats.foreign_rejected == 1, 5, "the decode ignoring a challenge not its own")
    assert "in-its-name/0" not in peers.peers
    # the genuine decode: served, though every session was taken
    transfer(prefill, recv, 1, np.arange(6))
    assert len(peers.peers) == 4 and any(s.startswith(f"{recv.instance_id}/") for s in peers.peers)
    # the squatters register again and evict the decode's idle session; it registers again and is served
    for i, sq in enumerate(squatters):
        sq.register(sender, f"squat/again/{i}")
    wait_for(lambda: all(not s.startswith(f"{recv.instance_id}/") for s in peers.peers), 5, "the decode evicted")
    transfer(prefill, recv, 2, np.arange(6) + 10)
    assert len(peers.peers) <= 4
    assert sender.num_rooms() == recv.num_rooms() == 0
    assert sender.stats.bytes_written == 2 * 2 * 2 * len(SRC) * sender.layout.page_nbytes  # K, V x 2 layers x 2 rooms


def test_finding6_a_rogue_session_cannot_take_or_abort_the_victims_room(stack: ExitStack) -> None:
    cfg = dataclasses.replace(CFG, auth_token=TOKEN)
    fabric = LocalFabric()
    prefill = start_prefill(stack, fabric=fabric, cfg=cfg)
    sender = prefill.senders[0]
    recv = start_decode(stack, fabric=fabric, cfg=cfg)
    rogue = TokenHolder(stack, "rogue")
    rogue.register(sender, "rogue/0")
    wait_for(lambda: rogue.replies(m.RegisterState.ACCEPTED), 5, "the rogue registered")

    def ask(room: int, claim: bytes = b"") -> None:
        rogue.ep.send(sender.control_address, m.TransferRequest(room, "rogue/0", tuple(range(6)), 0, 0, claim=claim))

    # 1. first, before the prefill admitted the room: kept beside the victim's, refused at admission
    ask(11, claim=m.room_claim(11, [1, 2, 3]))
    wait_for(lambda: 11 in sender._book.rooms, 5, "the rogue's request at the prefill")
    transfer(prefill, recv, 11, np.arange(6))
    wait_for(lambda: rogue.statuses(11), 5, "the rogue's refusal")
    assert [st.state for st in rogue.statuses(11)] == [m.WireState.FAILED]
    # 2. after admission: refused at once, the victim unharmed
    claim = m.room_claim(12, PROMPT)
    sender.add_room(12, SRC, claim=claim)
    ask(12)
    wait_for(lambda: rogue.statuses(12), 5, "the rogue's refusal")
    assert "claim" in rogue.statuses(12)[0].reason
    recv.add_room(12, "127.0.0.1", prefill.port, np.arange(6) + 6, claim=claim)
    sender.send(12, 0, 22, last=True, aux=(5, -0.5))
    assert Results(recv).get(12)[1] is S and Results(sender).get(12)[1] is S
    # 3. an abort of an admitted room the victim has not asked for yet is not the rogue's
    claim = m.room_claim(15, PROMPT)
    sender.add_room(15, SRC, claim=claim)
    rejected = sender.stats.rejected_messages
    rogue.ep.send(sender.control_address, m.Abort(15, "rogue/0", m.Side.DECODE, "mine now"))
    wait_for(lambda: sender.stats.rejected_messages > rejected, 5, "the abort refused")
    assert sender.room_state(15) is TransferState.BOOTSTRAPPING
    recv.add_room(15, "127.0.0.1", prefill.port, np.arange(6) + 12, claim=claim)
    sender.send(15, 0, 22, last=True, aux=(5, -0.5))
    assert Results(recv).get(15)[1] is S and Results(sender).get(15)[1] is S
    # 4. a pre-abort of a room nobody asked for yet leaves a tombstone that stops no claimed room
    rogue.ep.send(sender.control_address, m.Abort(13, "rogue/0", m.Side.DECODE, "gone"))
    wait_for(lambda: rogue.statuses(13), 5, "the rogue's abort answered")
    transfer(prefill, recv, 13, np.arange(6) + 18)
    # 5. asking first and then aborting drops the rogue's claim only
    ask(14, claim=m.room_claim(14, [9]))
    wait_for(lambda: 14 in sender._book.rooms, 5, "the rogue's request at the prefill")
    claim = m.room_claim(14, PROMPT)
    recv.add_room(14, "127.0.0.1", prefill.port, np.arange(6) + 24, claim=claim)
    wait_for(lambda: len(sender._book.rooms[14].dests) == 2, 5, "both claims kept")
    rogue.ep.send(sender.control_address, m.Abort(14, "rogue/0", m.Side.DECODE, "changed my mind"))
    wait_for(lambda: len(rogue.statuses(14)) == 1, 5, "the rogue's claim dropped")
    sender.add_room(14, SRC, claim=claim)
    sender.send(14, 0, 22, last=True, aux=(5, -0.5))
    assert Results(recv).get(14)[1] is S and Results(sender).get(14)[1] is S
    # nothing was ever written to the rogue's address, and both sides hold nothing
    assert all(st.state is m.WireState.FAILED for st in rogue.got if isinstance(st, m.TransferStatus))
    assert sender.stats.rooms_succeeded == 5 and sender.stats.batches_failed == 0
    assert sender.num_rooms() == recv.num_rooms() == 0
