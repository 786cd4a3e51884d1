"""Registration challenges: a decode session belongs to whoever receives at its control address.

A RegisterPeer names the control address where the prefill will send the session's statuses,
heartbeats and aborts, and any holder of the deployment token can send one naming any address
(issue 45, finding 3: sessions registered in other endpoints' names filled a prefill's table).
So a prefill rank answers a registration without a valid challenge with a challenge, sent to that
control address (RegisterReply CHALLENGE), and registers the session only when the same
registration comes back carrying it: the registrant receives at the address it named. Control
frames are sealed for their destination address (auth.py), so nobody else can read a challenge
off the wire and replay it without also holding the token and sniffing the link, which the token
does not defend against anyway.

The challenge is stateless, like a SYN cookie: a timestamp and an HMAC (a key random per prefill
rank start) over it and the whole registration (session, addresses, layouts), so a flood of
registrations costs the prefill one small reply each and no memory. It is valid for `ttl_s`.

    challenges = Challenges()
    token = challenges.issue(reg, now)            # RegisterReply(CHALLENGE, challenge=token)
    challenges.answered(replace(reg, challenge=token), now)  # True within ttl_s
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import replace

from kvpipe.transfer.control.messages import RegisterPeer, encode

TAG_BYTES = 16
_TS = struct.Struct("<q")  # milliseconds of the issuing clock


class Challenges:
    def __init__(self, ttl_s: float = 30.0, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)
        self._ttl_ms = int(ttl_s * 1000)

    def _tag(self, stamp: bytes, msg: RegisterPeer) -> bytes:
        mac = hmac.new(self._key, b"kvpipe-register\0" + stamp, hashlib.sha256)
        mac.update(encode(replace(msg, challenge=b"")))
        return mac.digest()[:TAG_BYTES]

    def issue(self, msg: RegisterPeer, now: float) -> bytes:
        """The challenge `msg` (a registration without a valid one) must come back with."""
        stamp = _TS.pack(int(now * 1000))
        return stamp + self._tag(stamp, msg)

    def answered(self, msg: RegisterPeer, now: float) -> bool:
        """`msg` carries a challenge this rank issued for exactly this registration, not older
        than ttl_s (nor from the future)."""
        token = msg.challenge
        if len(token) != _TS.size + TAG_BYTES:
            return False
        stamp = token[: _TS.size]
        (issued_ms,) = _TS.unpack(stamp)
        if not 0 <= int(now * 1000) - issued_ms <= self._ttl_ms:
            return False
        return hmac.compare_digest(token[_TS.size :], self._tag(stamp, msg))
