"""FirstTokens: which engine outputs carry a request's first token (the engine thread waits for
the event loop to take those before its next forward)."""

from kvpipe.engine.request import FinishReason, TokenOutput
from kvpipe.server.first_token import FirstTokens


def _out(rid: str, n: int = 1, finish: FinishReason | None = None) -> TokenOutput:
    return TokenOutput(rid, tuple(range(n)), tuple(0.0 for _ in range(n)), finish)


def test_only_the_first_output_of_a_request_is_first() -> None:
    ft = FirstTokens()
    assert ft.any_first([_out("a")])
    assert not ft.any_first([_out("a")])
    assert ft.any_first([_out("a"), _out("b")])  # b's first rides along with a's second
    assert not ft.any_first([_out("a"), _out("b")])


def test_finished_requests_are_forgotten() -> None:
    ft = FirstTokens()
    assert ft.any_first([_out("a", finish=FinishReason.LENGTH)])  # first and last at once
    assert len(ft) == 0
    ft.any_first([_out("b")])
    assert not ft.any_first([_out("b", finish=FinishReason.STOP)])
    assert len(ft) == 0
    assert ft.any_first([_out("b")])  # a new request may reuse a finished rid


def test_outputs_without_tokens_are_not_first() -> None:
    ft = FirstTokens()
    assert not ft.any_first([_out("a", n=0, finish=FinishReason.ABORT)])  # rejected or aborted early
    assert len(ft) == 0


def test_reset_forgets_everything() -> None:
    ft = FirstTokens()
    ft.any_first([_out("a"), _out("b")])
    ft.reset()
    assert len(ft) == 0 and ft.any_first([_out("a")])
