"""Request timelines recorded by real engines (kvpipe/engine/timeline.py): a colocated engine with
chunked prefill, and a PD prefill + decode pair in one process (tests/helpers/pd_pair.py), layer
groups on. Checks the phases' order and that the components fit in the request's time; never how
long anything took."""

from __future__ import annotations

import math

import pytest

from kvpipe.engine.request import Req, TokenOutput
from kvpipe.engine.timeline import Phase, TimelineRecord
from tests.helpers.engine import GREEDY, make_engine, step_until_finished
from tests.helpers.pd_pair import make_pair, prompts

CHUNK = 24  # does not divide into pages of 16
LENS = [1, 17, 40, 100]


def final_record(outs: list[TokenOutput]) -> TimelineRecord:
    """The timeline of a request's final output (only that one carries it)."""
    assert all(o.timeline is None for o in outs[:-1])
    rec = outs[-1].timeline
    assert outs[-1].finish_reason is not None and rec is not None
    return rec


def tol(rec: TimelineRecord) -> float:
    """Float64 rounding of a few differences of monotonic readings of this magnitude."""
    return 8 * math.ulp(rec.events[-1].t)


def assert_chunks(rec: TimelineRecord, req: Req) -> None:
    """Each chunk's forward starts after the previous one ended; the chunks cover the tokens
    computed here (the prompt less its cached prefix)."""
    spans = [e for e in rec.events if e.phase in (Phase.FORWARD_START, Phase.FORWARD_END)]
    assert [e.phase for e in spans] == [Phase.FORWARD_START, Phase.FORWARD_END] * (len(spans) // 2)
    assert all(a.t <= b.t for a, b in zip(spans, spans[1:]))
    assert sum(e.value or 0 for e in spans if e.phase is Phase.FORWARD_START) == len(req.input_ids) - req.cached_tokens
    # rows of one batch share its CHUNK tokens: at least that many chunks, maybe more
    assert len(spans) // 2 >= math.ceil((len(req.input_ids) - req.cached_tokens) / CHUNK)


def assert_before(rec: TimelineRecord, *phases: Phase) -> None:
    """The phases happened in this order (first occurrence of each)."""
    ts = [rec.first(p) for p in phases]
    assert None not in ts, [p for p, t in zip(phases, ts) if t is None]
    assert ts == sorted(ts), list(zip(phases, ts))  # type: ignore[type-var]


def run(engine, reqs: list[Req]) -> dict[str, list[TokenOutput]]:
    outs: dict[str, list[TokenOutput]] = {}
    for r in reqs:
        engine.add_request(r)
    for o in step_until_finished(engine, reqs):
        outs.setdefault(o.rid, []).append(o)
    return outs


def test_colocated_chunked_timeline(tiny_model_dir) -> None:
    eng = make_engine(tiny_model_dir, chunk=CHUNK)
    try:
        reqs = [Req(f"c{i}", ids, GREEDY) for i, ids in enumerate(prompts(0, LENS))]
        outs = run(eng, reqs)
    finally:
        eng.shutdown()
    for r in reqs:
        rec = final_record(outs[r.rid])
        assert_before(rec, Phase.ARRIVED, Phase.SCHEDULED, Phase.FORWARD_START, Phase.FIRST_TOKEN, Phase.FINISHED)
        assert_chunks(rec, r)
        assert rec.last(Phase.FORWARD_END) <= rec.first(Phase.FIRST_TOKEN)  # type: ignore[operator]
        assert rec.first(Phase.SCHEDULED) <= rec.first(Phase.FORWARD_START)  # type: ignore[operator]
        assert not any(e.phase in (Phase.TRANSFER_START, Phase.PAGES_RESERVED) for e in rec.events)
        c = rec.components()
        assert set(c) == {"queue", "prefill_compute"}
        assert c["queue"] + c["prefill_compute"] <= rec.first(Phase.FINISHED) - rec.first(Phase.ARRIVED) + tol(rec)  # type: ignore[operator]


@pytest.mark.parametrize("groups", [1, 2])
def test_pd_pair_timelines(tiny_model_dir, groups: int) -> None:
    with make_pair(tiny_model_dir, CHUNK, layer_groups=groups, layer_groups_min_tokens=0) as pair:
        reqs = [pair.reqs(ids) for ids in prompts(1, LENS)]
        p_out, d_out = pair.run(reqs)
        st = pair.prefill.stats()["disaggregation"]
        pair.settle()
    total_bytes = 0
    for p, d in reqs:
        pr = final_record(p_out[p.rid])
        assert_before(
            pr,
            Phase.ARRIVED,
            Phase.SCHEDULED,
            Phase.FORWARD_START,
            Phase.FIRST_TOKEN,
            Phase.FINISHED,
            Phase.RELEASED,
        )
        assert_before(pr, Phase.BOOTSTRAPPED, Phase.TRANSFER_START, Phase.TRANSFER_DONE, Phase.RELEASED)
        assert_before(pr, Phase.FORWARD_START, Phase.TRANSFER_START)  # nothing is sent before it is computed
        assert_chunks(pr, p)
        # stretches of writes in flight, one after the other
        wire = [e for e in pr.events if e.phase in (Phase.TRANSFER_START, Phase.TRANSFER_DONE)]
        assert [e.phase for e in wire] == [Phase.TRANSFER_START, Phase.TRANSFER_DONE] * (len(wire) // 2)
        # the prefill answers once the transfer is over: its final output is the released one
        assert pr.last(Phase.TRANSFER_DONE) <= pr.last(Phase.RELEASED) == pr.events[-1].t  # type: ignore[operator]
        piped = [e for e in pr.events if e.phase is Phase.LAYER_GROUP_DONE]
        if groups == 1:
            assert piped == []
        else:  # every chunk ran as `groups` groups, each handed to the sender inside its forward
            assert len(piped) == groups * (sum(e.phase is Phase.FORWARD_START for e in pr.events))
        c = pr.components()
        assert {"queue", "prefill_compute", "bootstrap_wait", "transfer", "exposed_transfer"} <= set(c)
        span = pr.last(Phase.RELEASED) - pr.first(Phase.ARRIVED)  # type: ignore[operator]
        assert c["queue"] + c["prefill_compute"] + c["exposed_transfer"] <= span + tol(pr)
        assert pr.transfer_bytes is not None and pr.transfer_bytes > 0
        total_bytes += pr.transfer_bytes

        dr = final_record(d_out[d.rid])
        assert_before(dr, Phase.ARRIVED, Phase.PAGES_RESERVED, Phase.KV_ARRIVED, Phase.FIRST_TOKEN, Phase.FINISHED)
        assert not any(e.phase in (Phase.SCHEDULED, Phase.FORWARD_START) for e in dr.events)  # no prompt computed
        dc = dr.components()
        assert set(dc) == {"decode_wait", "kv_wait", "decoding"}
        d_span = dr.first(Phase.FINISHED) - dr.first(Phase.ARRIVED)  # type: ignore[operator]
        assert sum(dc.values()) == pytest.approx(d_span, abs=tol(dr))
    assert total_bytes == st["bytes_written"]  # the per-request bytes are the sender's, all of them


def test_recording_off_records_nothing_and_changes_no_output(tiny_model_dir) -> None:
    """--disable-request-metrics (ServerConfig.request_metrics False): no output carries a
    timeline, no request holds an event, and the tokens are the recording engine's."""
    got: dict[bool, dict[str, list[TokenOutput]]] = {}
    held: list[Req] = []
    for recording in (True, False):
        eng = make_engine(tiny_model_dir, chunk=CHUNK, request_metrics=recording)
        try:
            reqs = [Req(f"c{i}", ids, GREEDY) for i, ids in enumerate(prompts(0, LENS))]
            got[recording] = run(eng, reqs)
        finally:
            eng.shutdown()
        if not recording:
            held = reqs
    tokens = {rec: {rid: [t for o in outs for t in o.token_ids] for rid, outs in got[rec].items()} for rec in got}
    assert tokens[False] == tokens[True]
    assert all(o.timeline is None for outs in got[False].values() for o in outs)
    assert all(final_record(outs).events for outs in got[True].values())
    assert all(r.timeline.events == [] and not r.timeline.enabled for r in held)
