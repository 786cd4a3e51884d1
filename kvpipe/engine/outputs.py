"""The engine's answers (TokenOutput) for one request, built from the request as it stands."""

from __future__ import annotations

from dataclasses import replace

from kvpipe.engine.request import FinishReason, Req, TokenOutput
from kvpipe.engine.timeline import TimelineRecord


def final_record(req: Req) -> TimelineRecord | None:
    """The timeline that goes with a finished request's output (None while it runs)."""
    return req.timeline.record() if req.finished else None


def step_output(req: Req, num_new: int, with_spec: bool = False) -> TokenOutput:
    """A step's news: the `num_new` tokens it appended (req.output_ids' last) and the finish if it
    ended; `with_spec`: a finished request's speculative counts go with it."""
    ids = tuple(req.output_ids[-num_new:]) if num_new else ()
    lps = tuple(req.output_logprobs[-num_new:]) if num_new else ()
    spec = replace(req.spec) if with_spec and req.finished and req.spec is not None else None
    return TokenOutput(
        req.rid,
        ids,
        lps,
        req.finish_reason,
        req.finish_detail,
        len(req.input_ids),
        req.cached_tokens,
        spec=spec,
        timeline=final_record(req),
    )


def finish_output(req: Req) -> TokenOutput:
    """A finish with no new token (an abort, a request that can never run)."""
    return TokenOutput(
        req.rid,
        (),
        (),
        req.finish_reason,
        req.finish_detail,
        len(req.input_ids),
        req.cached_tokens,
        timeline=req.timeline.record(),
    )


def abort_output(req: Req, message: str) -> TokenOutput:
    """An ABORT answer for a request finished otherwise earlier (its answer was held back)."""
    return TokenOutput(
        req.rid,
        (),
        (),
        FinishReason.ABORT,
        message,
        len(req.input_ids),
        req.cached_tokens,
        timeline=req.timeline.record(),
    )
