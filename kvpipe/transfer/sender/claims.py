"""Who may claim a room on a prefill rank: the decode that was sent the request (issue 45, finding 6).

A room id travels in the router's request to both servers and nowhere else is it bound to a
decode; before, the first TransferRequest naming a room took it, so a token holder that asked for
a room before the genuine decode made the genuine request fail as a "duplicate bootstrap_room"
(and would have received its KV). Now a request carries a claim, `messages.room_claim(room,
prompt)`, which the prefill computes from its own copy of the request when its engine admits the
room (SenderRoom.claim):
- a room already admitted accepts only requests with its claim;
- before admission (the decode is often first) requests are kept per claim group, a group being
  one decode (control address) and one claim: several may wait side by side, and admission keeps
  the first group whose claim is the room's and refuses the others with a failed status;
- an abort, or the death of a decode, from one group before admission drops that group only; a
  tombstone a session's messages made (a refused request, an abort of a room never seen) stops a
  later admission or request only when it carries the same claim.
A room added without a claim (bare senders in tests and benchmarks) keeps the old rule: the first
group takes it. What it cannot do: a token holder who reads the client's request (the router, a
sniffer of the plain HTTP) knows the prompt and can claim as well as the decode.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpipe.transfer.sender.plan_types import Destination
from kvpipe.transfer.sender.room import SenderRoom


def _key(d: Destination) -> tuple[str, bytes]:
    return d.control_address, d.claim


def group(r: SenderRoom, session: str) -> list[str]:
    """Sessions of the room's claim group that `session` belongs to."""
    me = r.dests[session]
    return [s for s, d in r.dests.items() if _key(d) == _key(me)]


def conflict(r: SenderRoom, control_address: str, decode_rank: int, claim: bytes, expected: int) -> str | None:
    """Why a request (its decode's control address and rank, its claim, the destinations its TP
    pairing gives this room) cannot join the room's destinations, or None."""
    if r.src_pages is not None and r.claim is not None and claim != r.claim:
        return f"room {r.room}: the request's claim does not name this room's prompt"
    same = [d for d in r.dests.values() if _key(d) == (control_address, claim)]
    others = len(same) < len(r.dests)
    unclaimed = not claim and not any(d.claim for d in r.dests.values())
    if (
        (others and (r.src_pages is not None or unclaimed))  # admitted, or no claims: the first decode's
        or len(same) >= expected
        or any(d.decode_rank == decode_rank or d.expected != expected for d in same)
    ):
        return f"room {r.room} is already bound to another decode (duplicate bootstrap_room?)"
    return None


def losers(r: SenderRoom) -> list[str]:
    """At admission: the sessions of every claim group but the one that keeps the room (the first
    whose claim is the room's; the first of all when the room has no claim)."""
    keys = list(dict.fromkeys(_key(d) for d in r.dests.values()))
    fits = [k for k in keys if r.claim is None or k[1] == r.claim]
    keep = fits[0] if fits else None
    return [s for s, d in r.dests.items() if _key(d) != keep]


def other_groups(r: SenderRoom, sessions: Iterable[str]) -> bool:
    """The room has destinations outside `sessions` (another claim group waits for it)."""
    mine = set(sessions)
    return any(s not in mine for s in r.dests)


def tomb_applies(by: str | None, tomb_claim: bytes | None, claim: bytes | None) -> bool:
    """A tombstone stops a room (`claim`: the room's or the request's) when our engine ran that
    room (`by` None), or the room has no claim (the old rule), or the claims agree: a stranger's
    tombstone without one stops no claimed room."""
    return by is None or claim is None or tomb_claim == claim
