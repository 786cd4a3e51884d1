"""Engine finish logic, aborts, thread safety, seeded sampling and the PD seams."""

import random
import re
import threading
import time

import pytest

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from tests.helpers.engine import make_engine, prompts
from tests.helpers.recording_connector import RecordingConnector

PROMPT = prompts(3)[2]  # 17 tokens


@pytest.fixture(scope="module")
def eng(tiny_model_dir):
    e = make_engine(tiny_model_dir, chunk=33)
    yield e
    e.shutdown()


def run(eng: Engine, reqs: list[Req], max_steps: int = 2000) -> dict[str, list]:
    """Add reqs, step until all finished; TokenOutputs per rid."""
    outs: dict[str, list] = {r.rid: [] for r in reqs}
    for r in reqs:
        eng.add_request(r)
    for _ in range(max_steps):
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
        if all(r.finished for r in reqs) and not eng.has_work():
            return outs
    raise AssertionError("engine did not finish")


def params(**kw) -> SamplingParams:
    base = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


@pytest.fixture(scope="module")
def ref(eng):
    r = eng.generate([PROMPT], params())[0]
    assert len(r["output_ids"]) == 24
    return r


def test_max_new_tokens_and_outputs(eng, ref):
    req = Req("m", PROMPT, params(max_new_tokens=5), return_logprob=True)
    outs = run(eng, [req])["m"]
    assert [o.token_ids[0] for o in outs] == ref["output_ids"][:5]
    assert all(len(o.token_ids) == len(o.logprobs) == 1 and o.logprobs[0] < 0 for o in outs)
    assert all(o.prompt_tokens == len(PROMPT) and o.cached_tokens == 0 for o in outs)
    assert [o.finish_reason for o in outs] == [None] * 4 + [FinishReason.LENGTH]
    assert req.output_logprobs == [o.logprobs[0] for o in outs]


def test_eos_and_ignore_eos(eng, ref):
    tok = ref["output_ids"][6]
    k = ref["output_ids"].index(tok)
    r1 = Req("e1", PROMPT, params(ignore_eos=False), eos_token_ids=(tok,))
    r2 = Req("e2", PROMPT, params(ignore_eos=True), eos_token_ids=(tok,))
    outs = run(eng, [r1, r2])
    assert r1.output_ids == ref["output_ids"][: k + 1]
    assert (r1.finish_reason, r1.finish_detail) == (FinishReason.STOP, tok)
    assert outs["e1"][-1].finish_reason is FinishReason.STOP and outs["e1"][-1].finish_detail == tok
    assert r2.output_ids == ref["output_ids"] and r2.finish_reason is FinishReason.LENGTH


def test_stop_token_ids(eng, ref):
    tok = ref["output_ids"][9]
    k = ref["output_ids"].index(tok)
    r = Req("s", PROMPT, params(stop_token_ids=(tok,)))
    run(eng, [r])
    assert r.output_ids == ref["output_ids"][: k + 1] and r.finish_detail == tok


def test_stop_string_trims_text(eng, ref):
    text = ref["text"]
    m = re.search(r"[A-Za-z]{2}", text[3:])
    assert m, f"no ascii pair in {text!r}"
    stop = m.group(0)
    cut = text.find(stop)
    res = eng.generate([PROMPT], params(stop=("never-there", stop)))[0]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert res["text"] == text[:cut]
    ids = res["output_ids"]
    assert ids == ref["output_ids"][: len(ids)]
    # it stopped at the first token that completed the stop string, not later
    assert stop in eng.tokenizer.decode(ids) and stop not in eng.tokenizer.decode(ids[:-1])


def test_max_new_tokens_zero_finishes_after_prefill(eng):
    r = Req("z", PROMPT, params(max_new_tokens=0))
    outs = run(eng, [r])["z"]
    assert r.output_ids == [] and r.finish_reason is FinishReason.LENGTH
    assert len(outs) == 1 and outs[0].token_ids == ()


def test_never_fits_is_aborted(tiny_model_dir):
    cfg = ServerConfig(
        model_path=str(tiny_model_dir),
        cache=CacheConfig(page_size=16, num_pages=4),
        scheduler=SchedulerConfig(context_length=100),
    )
    e = Engine(cfg)
    try:
        too_long = Req("ctx", list(range(3, 93)), params(max_new_tokens=20))
        too_big = Req("kv", list(range(3, 63)), params(max_new_tokens=20))
        ok = Req("ok", list(range(3, 13)), params(max_new_tokens=4))
        outs = run(e, [too_long, too_big, ok])
        assert outs["ctx"][-1].finish_reason is FinishReason.ABORT and "context length" in outs["ctx"][-1].finish_detail
        assert outs["kv"][-1].finish_reason is FinishReason.ABORT and "KV cache" in outs["kv"][-1].finish_detail
        assert ok.finish_reason is FinishReason.LENGTH and e.allocator.num_free == 4
        assert e.context_length == 100
    finally:
        e.shutdown()


def test_abort_waiting_and_running(eng):
    n0 = eng.allocator.num_free
    a = Req("ab1", PROMPT, params(max_new_tokens=100))
    eng.add_request(a)
    eng.step()  # prefill
    eng.step()  # decode
    assert len(a.output_ids) >= 1 and eng.allocator.num_free < n0
    b = Req("ab2", PROMPT, params())
    eng.add_request(b)
    eng.abort("ab2")  # still in the inbox
    eng.abort("ab1")
    eng.abort("nobody")
    outs = eng.step()
    assert {o.rid: o.finish_reason for o in outs} == {"ab1": FinishReason.ABORT, "ab2": FinishReason.ABORT}
    assert eng.allocator.num_free == n0 and not eng.has_work()
    eng.add_request(Req("ab1", PROMPT, params(max_new_tokens=1)))  # the rid is free again
    run(eng, [])


def test_duplicate_rid_rejected(eng):
    eng.add_request(Req("dup", PROMPT, params(max_new_tokens=2)))
    with pytest.raises(ValueError, match="dup"):
        eng.add_request(Req("dup", PROMPT, params(max_new_tokens=2)))
    run(eng, [])


def test_seeded_sampling_independent_of_batch(eng):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = eng.generate([PROMPT], sp)[0]["output_ids"]
    others = [
        SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True),
        SamplingParams(max_new_tokens=15, temperature=0.0, ignore_eos=True),
        sp,
        SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True),
    ]
    ps = prompts(2) + [PROMPT, PROMPT]
    mixed = eng.generate(ps, others)
    assert mixed[2]["output_ids"] == alone
    assert mixed[3]["output_ids"] != alone  # another seed, another stream


def test_threaded_add_and_abort(eng):
    n0 = eng.allocator.num_free
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop():
        try:
            while not stop.is_set():
                if eng.has_work():
                    eng.step()
                else:
                    time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    rnd = random.Random(0)
    reqs = [Req(f"t{i}", prompts(6, seed=i)[i % 6], params(max_new_tokens=rnd.randint(1, 12))) for i in range(20)]
    try:
        for r in reqs:
            eng.add_request(r)
            if rnd.random() < 0.3:
                eng.abort(r.rid)
        deadline = time.monotonic() + 60
        while not all(r.finished for r in reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(10)
    assert not errors and all(r.finished for r in reqs)
    assert any(r.finish_reason is FinishReason.ABORT for r in reqs)
    assert eng.allocator.num_free == n0


def step_until(eng: Engine, req: Req, max_steps: int = 100) -> list:
    """Step until `req` finished (bounded); the outputs of those steps."""
    outs: list = []
    for _ in range(max_steps):
        outs += eng.step()
        if req.finished:
            return outs
    raise AssertionError(f"{req.rid} did not finish in {max_steps} steps")


def test_connector_seam_holds_pages_and_defers_the_answer(tiny_model_dir):
    """A connector sees every committed chunk and the first token; a finished request whose
    transfer owns its pages keeps them (and its rid), and its answer waits for the transfer."""
    conn = RecordingConnector(hold=True)
    e = make_engine(tiny_model_dir, chunk=7, connector=conn)
    try:
        with pytest.raises(ValueError, match="refused by the connector"):
            e.add_request(Req("refuse-me", PROMPT, params(max_new_tokens=1)))
        assert e.poll_interval() is None  # idle: the server loop sleeps until new input
        r = Req("p", PROMPT, params(max_new_tokens=1))
        e.add_request(r)
        assert e.poll_interval() == 0.0
        outs = step_until(e, r)
        assert conn.chunks == [("p", 0, 7), ("p", 7, 14), ("p", 14, 17)] and conn.firsts == r.output_ids
        assert conn.finished == [("p", FinishReason.LENGTH)] and outs == []  # held: no answer yet
        assert e.stats()["num_held"] == 1 and e.allocator.num_used == 2 and e.poll_interval() == 0.01
        with pytest.raises(ValueError):  # its rid stays taken while the pages are held
            e.add_request(Req("p", PROMPT, params(max_new_tokens=1)))
        conn.end_transfer("p")
        outs = e.step()
        assert [(o.rid, o.token_ids, o.finish_reason) for o in outs] == [
            ("p", tuple(r.output_ids), FinishReason.LENGTH)
        ]
        assert e.allocator.num_used == 0 and e.stats()["num_held"] == 0
        # an abort while held answers at once; a failed transfer of a held request answers nothing more
        q = Req("q", PROMPT, params(max_new_tokens=1))
        e.add_request(q)
        step_until(e, q)
        e.abort("q")
        assert [(o.rid, o.finish_reason) for o in e.step()] == [("q", FinishReason.ABORT)]
        assert e.allocator.num_used == 2  # its transfer still owns the pages
        conn.end_transfer("q", ok=False, reason="gone")
        assert e.step() == [] and e.allocator.num_used == 0
        assert e.poll_interval() is None
    finally:
        e.shutdown()


def test_remote_request_enters_decode(tiny_model_dir, ref):
    """A REMOTE request whose KV another engine computed decodes to the same tokens (PD seam)."""
    src_conn = RecordingConnector(hold=True)
    src = make_engine(tiny_model_dir, connector=src_conn)
    dst_conn = RecordingConnector(remote=True)
    dst = make_engine(tiny_model_dir, connector=dst_conn)
    try:
        r = Req("pd", PROMPT, params(max_new_tokens=1))
        src.add_request(r)
        step_until(src, r)
        d = Req("pd", PROMPT, params())
        dst.add_request(d)
        dst.step()
        assert dst_conn.reserved == [d] and d.pages.size > 0 and dst.stats()["num_reserved"] == 1
        assert src_conn.worker is not None
        dst_conn.deliver(d, src_conn.worker.pool, r.pages, r.output_ids[0])
        src_conn.end_transfer("pd")
        src.step()
        step_until(dst, d)
        assert d.output_ids == ref["output_ids"]
        assert dst.allocator.num_free == dst.allocator.num_pages and src.allocator.num_used == 0
    finally:
        src.shutdown()
        dst.shutdown()
