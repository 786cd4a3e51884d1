"""finish_reason_json: SGLang's finish_reason object, built once for the engine's
`generate` results and the server's `/generate` responses."""

from __future__ import annotations

from kvpipe.engine.request import FinishReason, finish_reason_json


def test_running_request_has_none() -> None:
    assert finish_reason_json(None, None, 3) is None


def test_stop_carries_the_matched_string_or_token() -> None:
    assert finish_reason_json(FinishReason.STOP, "</s>", 5) == {"type": "stop", "matched": "</s>"}
    assert finish_reason_json(FinishReason.STOP, 2, 5) == {"type": "stop", "matched": 2}


def test_length_counts_the_completion_tokens() -> None:
    assert finish_reason_json(FinishReason.LENGTH, 99, 7) == {"type": "length", "length": 7}


def test_abort_always_has_a_message() -> None:
    assert finish_reason_json(FinishReason.ABORT, "KV transfer failed", 0) == {
        "type": "abort",
        "message": "KV transfer failed",
    }
    assert finish_reason_json(FinishReason.ABORT, None, 0) == {"type": "abort", "message": "aborted"}
