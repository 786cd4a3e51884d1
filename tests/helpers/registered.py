"""Registrations in book-level unit tests that play one side without its control endpoint: a
decode's registration as a SenderBook keeps it (with the challenge the book issues answered:
transfer/sender/challenge.py, as a real decode's second RegisterPeer carries it), and a prefill's
acceptance of a ReceiverBook's registrations (transfer/receiver/registration.py)."""

from __future__ import annotations

from dataclasses import replace

from kvpipe.transfer.control.bootstrap_address import BootstrapAddress
from kvpipe.transfer.control.messages import RegisterPeer, RegisterReply, RegisterState
from kvpipe.transfer.receiver.book import ReceiverBook
from kvpipe.transfer.sender.book import SenderBook


def register_answered(book: SenderBook, msg: RegisterPeer, now: float = 0.0) -> None:
    """Hand `book` the registration `msg` with its challenge answered, at `now`."""
    book.on_message(replace(msg, challenge=book.challenges.issue(msg, now)), now)


def accept_registrations(book: ReceiverBook, addr: BootstrapAddress | tuple[str, int], now: float = 0.0) -> None:
    """Every prefill rank of the instance `book` knows at `addr` accepts the registrations it waits
    for (RegisterReply ACCEPTED, as a prefill sends once its challenge was answered)."""
    peer = book.prefills[addr]  # type: ignore[index]
    for p, r in sorted(peer.reg.pending):
        book.on_message(RegisterReply(peer.mine[r], f"{peer.info.instance_id}/{p}", RegisterState.ACCEPTED), now)
