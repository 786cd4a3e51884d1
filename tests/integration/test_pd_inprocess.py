"""A prefill Engine and a decode Engine (their PD connectors) in one process over the `local`
backend (real bootstrap server, real ZMQ control plane): greedy exactness against the colocated Engine and the request
lifecycle, stepping both engines from the test thread. Every wait is bounded."""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from pd_parity import expected_bytes

from kvpipe.config import CacheConfig, DisaggregationConfig, SchedulerConfig, ServerConfig
from kvpipe.disagg.decode import DecodeConnector
from kvpipe.disagg.prefill import PrefillConnector
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams, TokenOutput
from kvpipe.transfer.backends import FailureInjection
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.lifecycle import TransferState

pytestmark = pytest.mark.integration
PS = 16
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
_rooms = itertools.count(1000)


def cfg(
    model_dir: Path, mode: str, chunk: int = 0, pages: int = 128, radix_cache: bool = True, **disagg
) -> ServerConfig:
    # generous deadlines: a loaded 2-core host can stall an engine step for a second
    d = dict(
        mode=mode,
        bootstrap_port=0,
        transfer_backend="local",
        bootstrap_timeout_s=20.0,
        waiting_timeout_s=30.0,
        heartbeat_interval_s=0.5,
        transfer_timeout_s=10.0,
    )
    return ServerConfig(
        model_path=str(model_dir),
        cache=CacheConfig(page_size=PS, num_pages=pages, radix_cache=radix_cache),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=4096),
        disaggregation=DisaggregationConfig(**{**d, **disagg}),
    )


@dataclass
class Pair:
    prefill: Engine
    decode: Engine

    @property
    def prefill_connector(self) -> PrefillConnector:
        c = self.prefill.connector
        assert isinstance(c, PrefillConnector) and c.local_worker is not None
        return c

    @property
    def bootstrap_port(self) -> int:
        return self.prefill_connector.bootstrap_port

    @property
    def sender(self):
        """Rank 0's KVSender (in its TransferWorker)."""
        return self.prefill_connector.local_worker.sender

    @property
    def pipeline(self):
        return self.prefill_connector.pipeline

    @property
    def layout(self):
        return self.prefill_connector.local_worker.layout

    @property
    def receiver(self):
        assert isinstance(self.decode.connector, DecodeConnector)
        return self.decode.connector.receiver

    def reqs(
        self, ids: list[int], params: SamplingParams = GREEDY, room: int | None = None, rid: str | None = None
    ) -> tuple[Req, Req]:
        room = next(_rooms) if room is None else room
        rid = rid or f"r{room}"
        p = Req(rid, list(ids), params, bootstrap_room=room)
        d = Req(
            rid, list(ids), params, bootstrap_host="127.0.0.1", bootstrap_port=self.bootstrap_port, bootstrap_room=room
        )
        return p, d

    def run(
        self, pairs: list[tuple[Req | None, Req | None]], timeout_s: float = 60.0, until=None
    ) -> tuple[dict[str, list[TokenOutput]], dict[str, list[TokenOutput]]]:
        """Add the requests, step both engines until every one finished on both sides (or
        `until()` holds); returns the outputs per rid of prefill and decode."""
        p_out: dict[str, list[TokenOutput]] = {}
        d_out: dict[str, list[TokenOutput]] = {}
        for p, d in pairs:
            if p is not None:
                self.prefill.add_request(p)
            if d is not None:
                self.decode.add_request(d)
        done = until or (
            lambda: (
                all(_finished(p_out, p) for p, _ in pairs if p is not None)
                and all(_finished(d_out, d) for _, d in pairs if d is not None)
            )
        )
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end, f"not done after {timeout_s}s: {self.prefill.stats()} {self.decode.stats()}"
            for out in self.prefill.step():
                p_out.setdefault(out.rid, []).append(out)
            for out in self.decode.step():
                d_out.setdefault(out.rid, []).append(out)
        return p_out, d_out

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step until both sides are idle with every page free."""
        end = time.monotonic() + timeout_s
        while True:
            self.prefill.step()
            self.decode.step()
            ps, ds = self.prefill.stats(), self.decode.stats()
            if (
                not self.prefill.has_work()
                and not self.decode.has_work()
                and ps["free_pages"] == ps["total_pages"]
                and ds["free_pages"] == ds["total_pages"]
            ):
                return
            assert time.monotonic() < end, f"pages leaked: prefill {ps}, decode {ds}"


def _finished(outs: dict[str, list[TokenOutput]], req: Req) -> bool:
    return any(o.finish_reason is not None for o in outs.get(req.rid, []))


def tokens(outs: list[TokenOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@contextlib.contextmanager
def make_pair(
    model_dir: Path,
    chunk: int = 0,
    p_pages: int = 128,
    d_pages: int = 128,
    inject=None,
    prefill_radix_cache: bool = True,
    decode_radix_cache: bool = False,
    **disagg,
):
    """Prefill + decode engines; the prefill keeps its prefix cache unless told otherwise, the
    decode has one with `decode_radix_cache`."""
    fabric = LocalFabric()
    with contextlib.ExitStack() as es:
        pb, db = LocalBackend(fabric, inject=inject), LocalBackend(fabric)
        es.callback(pb.close)
        es.callback(db.close)
        p_cfg = cfg(model_dir, "prefill", chunk, p_pages, prefill_radix_cache, **disagg)
        prefill = Engine(p_cfg, PrefillConnector(p_cfg, pb))
        es.callback(prefill.shutdown)
        d_cfg = cfg(model_dir, "decode", 0, d_pages, decode_radix_cache=decode_radix_cache, **disagg)
        decode = Engine(d_cfg, DecodeConnector(d_cfg, db))
        es.callback(decode.shutdown)
        yield Pair(prefill, decode)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy outputs of the colocated engine with no prefix cache (memoized)."""
    yield from colocated_greedy(tiny_model_dir)


def colocated_greedy(model_dir: Path):
    """Generator of a memoized greedy reference (the colocated engine, no prefix cache) for a fixture."""
    eng = Engine(
        ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    cache: dict[tuple, list[int]] = {}

    def ref(ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(ids), params)
        if key not in cache:
            cache[key] = eng.generate([ids], params)[0]["output_ids"]
        return cache[key]

    yield ref
    eng.shutdown()


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 290) for _ in range(n)] for n in lens]


def failures_then_decode_abort(model_dir: Path, reference, check_free=lambda pair: None) -> None:
    """Injected write failures (seeded: some rooms fail, some succeed with the colocated tokens),
    then a decode abort while the prefill computes; after each, both sides settle with every page
    free, and `check_free(pair)` checks whatever else must be free (state slots)."""
    with make_pair(model_dir, chunk=32, inject=FailureInjection(prob=0.3, seed=3)) as pair:
        ps = prompts(11, [20, 64, 90, 130, 47])
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs)
        failed = [d for _, d in reqs if d.finish_reason is FinishReason.ABORT]
        ok = [(d, ids) for (_, d), ids in zip(reqs, ps) if d.finish_reason is not FinishReason.ABORT]
        assert failed and ok, "the seed should give both outcomes"
        for d, ids in ok:
            assert d.output_ids == reference(ids)
        pair.settle()
        check_free(pair)
        a = pair.reqs(prompts(1, [200])[0])
        pair.prefill.add_request(a[0])
        pair.decode.add_request(a[1])
        pair.prefill.step()
        pair.decode.step()
        pair.decode.abort(a[1].rid)
        pair.run([], until=lambda: a[0].finished and a[1].finished)
        assert a[1].finish_reason is FinishReason.ABORT
        pair.settle()
        check_free(pair)


def greedy_and_bytes_as_predicted(
    model_dir: Path,
    reference,
    chunk: int,
    groups: int,
    lens: list[int],
    check=lambda pair, stats: None,
    check_free=lambda pair: None,
) -> None:
    """Prompts of `lens` through a pair with chunked prefill of `chunk` and `groups` layer groups:
    greedy tokens equal `reference`, every room succeeds, the bytes written are
    pd_parity.expected_bytes, `check(pair, stats)` asserts what else the model family implies;
    then both sides settle with every page free and `check_free(pair)` checks the rest."""
    ps = prompts(chunk + groups, lens)
    with make_pair(model_dir, chunk, layer_groups=groups) as pair:
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs)
        for (p, d), ids in zip(reqs, ps):
            assert d.output_ids == reference(ids), f"prompt of {len(ids)} tokens: {d.finish_detail}"
        st = pair.prefill.stats()["disaggregation"]
        assert (st["rooms_succeeded"], st["rooms_failed"]) == (len(ps), 0)
        assert st["bytes_written"] == expected_bytes(model_dir, lens, PS, 1, 1)
        if groups > 1:
            assert pair.pipeline.counters.batches_by_groups.get(groups, 0) > 0
        check(pair, st)
        pair.settle()
        check_free(pair)


LENS = [1, 2, 15, 16, 17, 40, 100, 333]


@pytest.mark.parametrize("chunk", [0, 24])  # 24 does not divide into pages of 16
def test_greedy_matches_colocated(tiny_model_dir, reference, chunk):
    ps = prompts(chunk, LENS)
    with make_pair(tiny_model_dir, chunk) as pair:
        reqs = [pair.reqs(ids) for ids in ps]
        p_out, d_out = pair.run(reqs)
        for (p, d), ids in zip(reqs, ps):
            assert d.output_ids == reference(ids), f"prompt of {len(ids)} tokens: {d.finish_detail} {p_out.get(p.rid)}"
            assert tokens(d_out[d.rid]) == d.output_ids  # streamed token by token, first one included
            assert d_out[d.rid][0].token_ids == (d.output_ids[0],) and d.finish_reason is FinishReason.LENGTH
            final = p_out[p.rid][-1]  # the prefill answers with its first token once the KV landed
            assert final.finish_reason is FinishReason.LENGTH and final.token_ids == (d.output_ids[0],)
        st = pair.prefill.stats()["disaggregation"]
        assert st["rooms_succeeded"] == len(ps) and st["rooms_failed"] == 0 and st["bytes_written"] > 0
        pair.settle()


def test_first_token_finishes(tiny_model_dir, reference):
    """max_new_tokens=1 and EOS / stop id on the first token finish on the decode without a decode step."""
    ids = prompts(7, [50])[0]
    first = reference(ids)[0]
    with make_pair(tiny_model_dir) as pair:
        one = pair.reqs(ids, replace(GREEDY, max_new_tokens=1))
        eos = pair.reqs(ids, replace(GREEDY, ignore_eos=False))
        eos[1].eos_token_ids = (first,)
        stop = pair.reqs(ids, replace(GREEDY, stop_token_ids=(first,)))
        _, d_out = pair.run([one, eos, stop])
        assert one[1].output_ids == [first] and one[1].finish_reason is FinishReason.LENGTH
        for _, d in (eos, stop):
            assert d.output_ids == [first] and d.finish_reason is FinishReason.STOP and d.finish_detail == first
            assert [o.token_ids for o in d_out[d.rid]] == [(first,)]
        assert pair.decode.stats()["num_running"] == 0
        pair.settle()


def test_rejections(tiny_model_dir):
    """Missing bootstrap info and rooms in use are refused; a prompt the prefill cannot hold
    fails on the decode at once, not after a timeout."""
    with make_pair(tiny_model_dir, p_pages=4) as pair:
        with pytest.raises(ValueError, match="bootstrap_room"):
            pair.prefill.add_request(Req("x", [5, 6], GREEDY))
        with pytest.raises(ValueError, match="bootstrap_host"):
            pair.decode.add_request(Req("x", [5, 6], GREEDY, bootstrap_room=1))
        p, d = pair.reqs([7] * 20, room=77)
        pair.prefill.add_request(p)
        with pytest.raises(ValueError, match="already in use"):
            pair.prefill.add_request(pair.reqs([7] * 20, room=77, rid="other")[0])
        pair.decode.add_request(d)
        with pytest.raises(ValueError, match="already in use"):
            pair.decode.add_request(pair.reqs([7] * 20, room=77, rid="other")[1])
        big_p, big_d = pair.reqs([9] * 100)  # 7 pages; the prefill pool has 4
        t0 = time.monotonic()
        p_out, _ = pair.run([(big_p, big_d)])
        assert time.monotonic() - t0 < 10.0  # well before the 20 s bootstrap and 30 s waiting timeouts
        assert p_out[big_p.rid][-1].finish_reason is FinishReason.ABORT
        assert big_d.finish_reason is FinishReason.ABORT and "prefill" in str(big_d.finish_detail)
        pair.run([], until=lambda: d.finished)
        assert d.output_ids and d.finish_reason is FinishReason.LENGTH
        pair.settle()


def test_injected_failures_and_aborts_free_pages(tiny_model_dir, reference):
    with make_pair(tiny_model_dir, chunk=32, inject=FailureInjection(prob=0.3, seed=3)) as pair:
        ps = prompts(11, [20, 64, 90, 130, 200, 47])
        reqs = [pair.reqs(ids) for ids in ps]
        _, d_out = pair.run(reqs)
        failed = [d for _, d in reqs if d.finish_reason is FinishReason.ABORT]
        ok = [(d, ids) for (_, d), ids in zip(reqs, ps) if d.finish_reason is not FinishReason.ABORT]
        assert failed and ok, "the seed should give both outcomes"
        for d in failed:
            assert "KV transfer failed" in str(d.finish_detail)
        for d, ids in ok:
            assert d.output_ids == reference(ids)
        pair.settle()
    with make_pair(tiny_model_dir, chunk=32) as pair:
        # Decode-side abort while the prefill still computes; prefill-side abort after its prefill.
        a = pair.reqs(prompts(1, [300])[0])
        b = pair.reqs(prompts(2, [40])[0])
        pair.prefill.add_request(a[0])
        pair.decode.add_request(a[1])
        pair.prefill.step()  # the first of ten chunks
        end = time.monotonic() + 30
        while pair.receiver.room_state(a[1].bootstrap_room) is not TransferState.WAITING_FOR_INPUT:
            assert time.monotonic() < end, "the decode never asked the prefill for the KV"
            pair.decode.step()
        pair.decode.abort(a[1].rid)
        t0 = time.monotonic()
        pair.run([b], until=lambda: a[0].finished and a[1].finished and b[1].finished)
        assert a[1].finish_reason is FinishReason.ABORT and b[1].finish_reason is FinishReason.LENGTH
        assert a[0].finish_reason is FinishReason.ABORT and a[0].num_cached < 300  # the prefill stopped early
        pair.settle()
        assert time.monotonic() - t0 < 15  # the abort reached the prefill; no timeout was involved
        c = pair.reqs(prompts(3, [40])[0])
        pair.decode.add_request(c[1])  # the prefill request comes later, is aborted when done
        pair.prefill.add_request(c[0])
        p_out, d_out = pair.run([], until=lambda: c[0].finished)
        pair.prefill.abort(c[0].rid)
        pair.run([], until=lambda: c[1].finished)
        assert c[1].finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)  # it may have landed already
        pair.settle()


def test_prefill_forward_error_reaches_decode(tiny_model_dir):
    with make_pair(tiny_model_dir) as pair:
        p, d = pair.reqs(prompts(5, [60])[0])
        pair.prefill.add_request(p)
        pair.decode.add_request(d)
        real_run = pair.prefill.runner.run

        def broken(*a, **kw):
            pair.prefill.runner.run = real_run  # fail once
            raise RuntimeError("device lost")

        pair.prefill.runner.run = broken
        with pytest.raises(RuntimeError, match="device lost"):
            for _ in range(1000):  # bounded: the first prefill forward raises
                pair.prefill.step()
        _, d_out = pair.run([], until=lambda: d.finished)
        assert d.finish_reason is FinishReason.ABORT and "forward failed: device lost" in str(d.finish_detail)
        pair.settle()
        ok = pair.reqs(prompts(6, [30])[0])  # both keep serving
        pair.run([ok])
        assert ok[1].finish_reason is FinishReason.LENGTH


def test_prefill_abort_before_its_forward_after_the_decode_asked(tiny_model_dir):
    """The decode's TransferRequest reached the prefill first; the prefill request is aborted
    while queued: the room fails on both sides and no room stays active (a regression: the sender
    buried a room it knew only from the decode, and the prefill waited for it forever)."""
    with make_pair(tiny_model_dir) as pair:
        p, d = pair.reqs(prompts(4, [30])[0])
        pair.decode.add_request(d)
        end = time.monotonic() + 30
        while pair.sender.room_state(p.bootstrap_room) is None:
            assert time.monotonic() < end, "the decode's request never reached the prefill"
            pair.decode.step()
        pair.prefill.add_request(p)
        pair.prefill.abort(p.rid)
        pair.run([], until=lambda: p.finished and d.finished)
        assert p.finish_reason is FinishReason.ABORT and d.finish_reason is FinishReason.ABORT
        pair.settle()
        assert pair.prefill.stats()["disaggregation"]["active_rooms"] == 0


def test_first_token_leaves_before_the_next_decode_forward(tiny_model_dir, reference):
    """The decode step that learns of the KV returns the prefill's first token at once (no decode
    forward in between), and the receiver wakes the engine's loop when the transfer news arrives."""
    import threading

    ids = prompts(11, [70])[0]
    with make_pair(tiny_model_dir) as pair:
        woke = threading.Event()
        pair.decode.set_wakeup(woke.set)
        p, d = pair.reqs(ids)
        pair.prefill.add_request(p)
        pair.decode.add_request(d)
        end = time.monotonic() + 60
        first: list[TokenOutput] = []
        while not first:
            assert time.monotonic() < end, "no first token within 60 s"
            pair.prefill.step()
            first = [o for o in pair.decode.step() if o.rid == d.rid]
        assert woke.is_set()
        assert first[0].token_ids == (reference(ids)[0],)
        assert d.output_ids == [reference(ids)[0]]  # the decode has not run a forward for it yet
        while not d.finished:
            assert time.monotonic() < end, "decode did not finish within 60 s"
            pair.prefill.step()
            pair.decode.step()
        assert d.output_ids == reference(ids)
        pair.settle()


def test_a_decode_abort_before_the_request_frees_the_prefill_at_once(tiny_model_dir):
    """A request still waiting for decode pages when it is aborted never asked for its KV: the
    decode tells the prefill, which frees the computed KV now instead of at its bootstrap timeout."""
    with make_pair(tiny_model_dir, d_pages=12) as pair:
        a = pair.reqs(prompts(3, [100])[0], replace(GREEDY, max_new_tokens=60))  # 10 of the 12 decode pages
        b = pair.reqs(prompts(4, [40])[0])  # 3 pages: waits for a
        pair.run([a], until=lambda: len(a[1].output_ids) > 1)
        pair.run([b], until=lambda: b[0].prefill_done and len(a[1].output_ids) > 4)
        assert not b[1].finished and pair.receiver.room_state(b[1].bootstrap_room) is None  # never asked
        assert pair.decode.stats()["num_waiting"] == 1, pair.decode.stats()
        pair.decode.abort(b[1].rid)
        outs: list[TokenOutput] = []
        end = time.monotonic() + 30  # (without the decode's word it times out at 20 s, with another reason)
        while not any(o.rid == b[0].rid for o in outs):
            assert time.monotonic() < end, "the prefill kept the request the decode gave up on"
            outs += pair.prefill.step()
            pair.decode.step()
        [final] = [o for o in outs if o.rid == b[0].rid]
        assert b[1].finish_reason is FinishReason.ABORT and final.finish_reason is FinishReason.ABORT
        assert "aborted by decode before its request" in str(final.finish_detail), final
        assert pair.prefill.stats()["disaggregation"]["active_rooms"] == 0
        pair.decode.abort(a[1].rid)
        pair.settle()
