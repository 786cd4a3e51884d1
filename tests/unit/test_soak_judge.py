"""The soak's judgement of how a request ended: a success, a clear error (with the server's
message), our own disconnect, or else unclear; no final status by the deadline is a hang."""

from __future__ import annotations

import pytest

from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Request
from kvpipe.qa.soak_tally import Judgement, judge


def _ended(end: End, message: str = "", status: int | None = 200) -> Outcome:
    return Outcome(Request(0, (1, 2), 4), end, 0.0, 1.0, 2, http_status=status, message=message)


@pytest.mark.parametrize(
    ("end", "message", "want"),
    [
        (End.OK, "", Judgement.SUCCESS),
        (End.HTTP_ERROR, "KV transfer failed for room 7", Judgement.ERROR),
        (End.HTTP_ERROR, "", Judgement.UNCLEAR),  # an empty 502, or {"error": {"message": ""}}
        (End.ABORT, "KV transfer failed", Judgement.ERROR),
        (End.ABORT, "", Judgement.UNCLEAR),  # finish_reason abort without a message
        (End.DISCONNECTED, "", Judgement.DISCONNECTED),
        (End.CUT, "", Judgement.UNCLEAR),
        (End.CONNECTION, "", Judgement.UNCLEAR),
        (End.TIMEOUT, "", Judgement.HANG),
    ],
)
def test_judgements(end: End, message: str, want: Judgement) -> None:
    assert judge(_ended(end, message)) is want
    assert want.acceptable == (want in (Judgement.SUCCESS, Judgement.ERROR, Judgement.DISCONNECTED))
