"""Server-side output bookkeeping with the real tiny-preset tokenizer: detokenisation, stop
strings (trim + hold-back while streaming), stop tokens, finish reasons."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.engine.request import FinishReason, SamplingParams, TokenOutput
from kvpipe.model.text.tokenizer import IncrementalDetokenizer, Tokenizer
from kvpipe.server.protocol import GenerateInput, TextOptions
from kvpipe.server.request_tracker import RequestTracker


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _tracker(tok: Tokenizer, stop: tuple[str, ...] = (), no_stop_trim: bool = False) -> RequestTracker:
    inp = GenerateInput(
        rid="r",
        input_ids=(1, 2, 3),
        params=SamplingParams(max_new_tokens=100, stop=stop),
        text_options=TextOptions(no_stop_trim=no_stop_trim),
    )
    return RequestTracker(inp, IncrementalDetokenizer(tok), start_time=0.0)


def _out(ids: list[int], reason: FinishReason | None = None, detail: object = None) -> TokenOutput:
    return TokenOutput("r", tuple(ids), tuple(-1.0 for _ in ids), reason, detail, prompt_tokens=3)


def _feed(tr: RequestTracker, ids: list[int], finish_last: tuple | None = None) -> list:
    outs = []
    for i, t in enumerate(ids):
        fin = finish_last if (finish_last and i == len(ids) - 1) else (None, None)
        outs.append(tr.update([_out([t], *fin)], now=float(i + 1)))
    return outs


def test_cumulative_text_matches_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, this is a test.", add_special_tokens=False)
    tr = _tracker(tok)
    outs = [o for o in _feed(tr, ids, (FinishReason.LENGTH, len(ids))) if o is not None]
    assert outs[-1].text == tok.decode(ids) == "Hello world, this is a test."
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert outs[-1].output_ids == ids and outs[-1].finish_reason_json() == {"type": "length", "length": len(ids)}
    assert outs[-1].e2e_latency == float(len(ids)) and tr.first_token_time == 1.0
    assert outs[-1].output_logprobs == [-1.0] * len(ids)


def test_stop_string_trimmed_and_never_streamed(tok: Tokenizer) -> None:
    ids = tok.encode("alpha STOP beta", add_special_tokens=False)
    tr = _tracker(tok, stop=("STOP",))
    outs = [o for o in _feed(tr, ids) if o is not None]
    assert all("S" not in o.text for o in outs)  # nothing that might become the stop string leaks
    final = outs[-1]
    assert (
        final.finished and final.text == "alpha " and final.finish_reason_json() == {"type": "stop", "matched": "STOP"}
    )
    assert tr.needs_engine_abort  # the engine had not stopped by itself
    assert tr.update([_out([5])], now=99.0) is None  # nothing after a finish


def test_no_stop_trim_keeps_the_stop_string(tok: Tokenizer) -> None:
    ids = tok.encode("alpha STOP beta", add_special_tokens=False)
    tr = _tracker(tok, stop=("STOP",), no_stop_trim=True)
    final = [o for o in _feed(tr, ids) if o is not None][-1]
    assert final.text == "alpha STOP"


def test_false_alarm_is_released(tok: Tokenizer) -> None:
    ids = tok.encode("a STAR is born", add_special_tokens=False)
    tr = _tracker(tok, stop=("STOP",))
    outs = [o for o in _feed(tr, ids, (FinishReason.LENGTH, len(ids))) if o is not None]
    assert outs[-1].text == "a STAR is born" and outs[-1].finish_reason is FinishReason.LENGTH
    assert not tr.needs_engine_abort


def test_engine_stop_token_kept_in_ids_not_text(tok: Tokenizer) -> None:
    ids = tok.encode("abc", add_special_tokens=False)
    stop_tok = tok.encode("!", add_special_tokens=False)[0]
    tr = _tracker(tok)
    outs = _feed(tr, ids + [stop_tok], (FinishReason.STOP, stop_tok))
    final = outs[-1]
    assert final.output_ids == ids + [stop_tok] and final.text == "abc"
    assert final.finish_reason_json() == {"type": "stop", "matched": stop_tok}


def test_abort_finish(tok: Tokenizer) -> None:
    tr = _tracker(tok)
    _feed(tr, tok.encode("xy", add_special_tokens=False))
    out = tr.update([_out([], FinishReason.ABORT, "aborted")], now=5.0)
    assert out is not None and out.finish_reason_json() == {"type": "abort", "message": "aborted"}
    assert out.text == "xy"
    tr2 = _tracker(tok)
    aborted = tr2.finish_abort("client gone", now=1.0)
    assert aborted.finished and aborted.completion_tokens == 0
