"""A prefill Engine and a decode Engine (their PD connectors) in one process over the `local`
backend (real bootstrap server, real ZMQ control plane), both stepped from the test thread, and
the checks the in-process PD tests of every model family run through such a pair. Every wait is
bounded."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpipe.config import (
    CacheConfig,
    DisaggregationConfig,
    FaultInjection,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from kvpipe.disagg.decode import DecodeConnector
from kvpipe.disagg.prefill import PrefillConnector
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams, TokenOutput
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from tests.helpers.pd_parity import KV_ITEMSIZE, expected_bytes
from tests.helpers.tolerance import Generation, Route, assert_close_logits, assert_same_generations

PS = 16
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
_rooms = itertools.count(1000)


def cfg(
    model_dir: Path,
    mode: str,
    chunk: int = 0,
    pages: int = 128,
    radix_cache: bool = True,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    **disagg,
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
        dtype=dtype,
        cache=CacheConfig(page_size=PS, num_pages=pages, radix_cache=radix_cache, kv_cache_dtype=kv_cache_dtype),
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
        worker = self.prefill_connector.local_worker
        assert worker is not None  # prefill_connector asserts it: rank 0 runs in-process
        return worker.sender

    @property
    def pipeline(self):
        return self.prefill_connector.pipeline

    @property
    def layout(self):
        worker = self.prefill_connector.local_worker
        assert worker is not None
        return worker.layout

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
        self,
        pairs: list[tuple[Req | None, Req | None]],
        timeout_s: float = 60.0,
        until=None,
        on_landed: Callable[[Pair, Req], None] | None = None,
    ) -> tuple[dict[str, list[TokenOutput]], dict[str, list[TokenOutput]]]:
        """Add the requests, step both engines until every one finished on both sides (or
        `until()` holds); returns the outputs per rid of prefill and decode.

        `on_landed(pair, decode_req)` runs once per decode request right after the decode step
        that reported its KV landed (its first token, from the prefill) and before any decode
        forward reads that KV: the negative controls corrupt the destination pool there."""
        p_out: dict[str, list[TokenOutput]] = {}
        d_out: dict[str, list[TokenOutput]] = {}
        decoding = {d.rid: d for _, d in pairs if d is not None}
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
                if on_landed is not None and out.rid in decoding and out.rid not in d_out:
                    on_landed(self, decoding[out.rid])
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


def landed_state(engine: Engine, req: Req) -> dict[str, torch.Tensor]:
    """A request's prompt KV and recurrent state as `engine` (rank 0) holds them now, by name
    ("layer 0 k", "state 2 conv"): each full layer's buffers token-major (pages [P, heads,
    page_size, d] -> [n_tokens, heads, d]; sliding layers, which hold only a window, are left out)
    and each linear layer's state slot. Copies."""
    pool, n = engine.runner.pool, len(req.input_ids)
    idx = torch.as_tensor(np.asarray(req.pages[: -(-n // pool.page_size)], dtype=np.int64))
    out = {}
    for layer in range(pool.num_layers):
        if layer in pool.swa_layers:
            continue
        for kind, buf in pool.layer_buffers(layer):
            paged = buf[idx]  # [P, heads, ps, d]
            out[f"layer {layer} {kind}"] = paged.transpose(1, 2).reshape(-1, *paged.shape[1::2])[:n].clone()
    state = engine.runner.state_pool
    if state is not None:
        assert req.state_slot is not None
        for i, layer in enumerate(state.layers):
            out[f"state {layer} conv"] = state.conv[i][req.state_slot].clone()
            out[f"state {layer} recurrent"] = state.recurrent[i][req.state_slot].clone()
    return out


def assert_landed_equals_cold(model_dir: Path, ps: list[list[int]], chunk: int) -> None:
    """What lands on the decode for each prompt (through a pair with chunked prefill of `chunk`,
    before any decode step: its prompt KV and recurrent state) is what a cold colocated engine
    holds after that prompt's whole prefill, within tolerance.logit_atol of each tensor (the same
    arithmetic, chunked otherwise). The truth is the colocated engine's own pool, not the planner."""
    landed: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}

    def keep(pair: Pair, d: Req) -> None:
        landed[tuple(d.input_ids)] = landed_state(pair.decode, d)

    with make_pair(model_dir, chunk) as pair:
        pair.run([pair.reqs(ids) for ids in ps], on_landed=keep)
        pair.settle()
    cold = Engine(
        ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=PS, num_pages=256, radix_cache=False))
    )
    want: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    try:
        reqs = [Req(f"cold-{i}", list(ids), GREEDY) for i, ids in enumerate(ps)]
        for r in reqs:
            cold.add_request(r)
        end = time.monotonic() + 60
        while len(want) < len(reqs):  # each prompt's state right after its prefill step
            assert time.monotonic() < end, "the cold prefill did not finish"
            cold.step()
            for r in reqs:
                if r.prefill_done and tuple(r.input_ids) not in want:
                    assert len(r.output_ids) == 1
                    want[tuple(r.input_ids)] = landed_state(cold, r)
        for r in reqs:
            cold.abort(r.rid)
        cold.step()
        mc = cold.model_config
    finally:
        cold.shutdown()
    for i, ids in enumerate(ps):
        got, exp = landed[tuple(ids)], want[tuple(ids)]
        assert got.keys() == exp.keys()
        for name in exp:
            assert_close_logits(got[name], exp[name], mc, len(ids), msg=f"prompt {i} ({len(ids)} tokens), {name}")


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
    kv_cache_dtype: str = "auto",
    decode_model_dir: Path | None = None,
    decode_cache: dict[str, Any] | None = None,
    decode_speculative: SpeculativeConfig | None = None,
    prefill_speculative: SpeculativeConfig | None = None,
    quantization: str | None = None,
    decode_config: dict[str, Any] | None = None,
    prefill_cache: dict[str, Any] | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    dtype: str = "auto",
    **disagg,
):
    """Prefill + decode engines; the prefill keeps its prefix cache unless told otherwise, the
    decode has one with `decode_radix_cache`; both compute in `dtype` (--dtype) and both pools store
    `kv_cache_dtype`; the decode
    decodes speculatively with `decode_speculative`, and the prefill runs `prefill_speculative`'s
    draft model (STANDALONE: its draft KV goes to the decode); both run `quantization`'s weights.
    Mismatched pairs (the handshake tests): the decode serves `decode_model_dir` instead,
    `decode_cache` overrides fields of its CacheConfig (page_size, kv_cache_dtype) and
    `decode_config` fields of its ServerConfig (quantization); `prefill_cache` overrides fields of
    the prefill's CacheConfig (a hybrid model's state and snapshot slots). With `prefill_tp` or
    `decode_tp` > 1 the servers have TP children (processes) and every rank its own Mooncake
    backend over loopback (the local backend copies inside one process only); `inject` then
    fails the prefill ranks' write batches."""
    fabric = LocalFabric()
    tp = prefill_tp > 1 or decode_tp > 1
    if tp:
        disagg = {"transfer_backend": "mooncake", **disagg}
    with contextlib.ExitStack() as es:
        pb: LocalBackend | None = None
        db: LocalBackend | None = None
        if not tp:
            pb, db = LocalBackend(fabric, inject=inject), LocalBackend(fabric)
            es.callback(pb.close)
            es.callback(db.close)
        p_cfg = cfg(model_dir, "prefill", chunk, p_pages, prefill_radix_cache, kv_cache_dtype, dtype, **disagg)
        p_cfg = dataclasses.replace(p_cfg, tp_size=prefill_tp)
        if tp and inject is not None:
            p_cfg = dataclasses.replace(p_cfg, disaggregation=dataclasses.replace(p_cfg.disaggregation, faults=inject))
        if prefill_speculative is not None:
            p_cfg = dataclasses.replace(p_cfg, speculative=prefill_speculative)
        if prefill_cache:
            p_cfg = dataclasses.replace(p_cfg, cache=dataclasses.replace(p_cfg.cache, **prefill_cache))
        p_cfg = dataclasses.replace(p_cfg, quantization=quantization)
        prefill = Engine(p_cfg, PrefillConnector(p_cfg, pb))
        es.callback(prefill.shutdown)
        d_cfg = cfg(
            decode_model_dir or model_dir,
            "decode",
            0,
            d_pages,
            decode_radix_cache=decode_radix_cache,
            kv_cache_dtype=kv_cache_dtype,
            dtype=dtype,
            **disagg,
        )
        d_cfg = dataclasses.replace(d_cfg, tp_size=decode_tp)
        if decode_cache:
            d_cfg = dataclasses.replace(d_cfg, cache=dataclasses.replace(d_cfg.cache, **decode_cache))
        if decode_speculative is not None:
            d_cfg = dataclasses.replace(d_cfg, speculative=decode_speculative)
        d_cfg = dataclasses.replace(d_cfg, **{"quantization": quantization, **(decode_config or {})})
        decode = Engine(d_cfg, DecodeConnector(d_cfg, db))
        es.callback(decode.shutdown)
        yield Pair(prefill, decode)


Reference = Callable[..., Generation]  # (prompt ids, params=GREEDY) -> the colocated generation


def colocated_greedy(
    model_dir: Path, kv_cache_dtype: str = "auto", quantization: str | None = None, dtype: str = "auto"
) -> Iterator[Reference]:
    """Generator of a memoized greedy reference (the colocated engine, no prefix cache; tokens and
    logprobs of each prompt run alone) for a fixture; `quantization`: its --quantization, `dtype`
    its --dtype."""
    pool = CacheConfig(page_size=PS, num_pages=256, radix_cache=False, kv_cache_dtype=kv_cache_dtype)
    eng = Engine(ServerConfig(model_path=str(model_dir), dtype=dtype, cache=pool, quantization=quantization))
    cache: dict[tuple, Generation] = {}

    def ref(ids: list[int], params: SamplingParams = GREEDY) -> Generation:
        key = (tuple(ids), params)
        if key not in cache:
            cache[key] = Generation.of(eng.generate([ids], params)[0])
        return cache[key]

    yield ref
    eng.shutdown()


def assert_pd_matches(
    reqs: Sequence[Req],
    ps: Sequence[Sequence[int]],
    reference: Reference,
    what: str = "PD vs colocated",
    route: Route = Route.SAME_PROCESS,
) -> None:
    """The finished decode requests `reqs` of prompts `ps` give the colocated reference's tokens and
    logprobs. Both engines run in this process with TP 1 and the same kernels: Route.SAME_PROCESS
    (a pair with TP children: Route.ACROSS_PROCESSES). The first token's logprob is the prefill's,
    carried in the aux data."""
    want = [reference(list(ids), r.params) for r, ids in zip(reqs, ps)]
    assert_same_generations([Generation.of_req(r) for r in reqs], want, route, ps, what)


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 290) for _ in range(n)] for n in lens]


# failures_then_decode_abort's and shared_prefix_failure_waves': the seed fails the first batch,
# and at most 2 batches fail on any backend (rank), so of their 5-6 rooms some fail and some
# succeed however the rooms' batches coalesce (timing: all 6 rooms failed once without the cap)
FAULTS = FaultInjection(prob=0.3, seed=3, max_failures=2)


def failures_then_decode_abort(
    model_dir: Path,
    reference: Reference,
    check_free=lambda pair: None,
    inject: FaultInjection = FAULTS,
    route: Route = Route.SAME_PROCESS,
    **pair_kw: Any,
) -> None:
    """Injected write failures (seeded: some rooms fail, some succeed with the colocated tokens),
    then a decode abort while the prefill computes; after each, both sides settle with every page
    free, and `check_free(pair)` checks whatever else must be free (state slots, draft pages).
    `inject`: the failures (its max_failures times the prefill ranks below the 5 rooms: both
    outcomes whatever the timing); `route`: assert_pd_matches'; `pair_kw`: more of make_pair's arguments
    (speculative settings, TP sizes)."""
    with make_pair(model_dir, chunk=32, inject=inject, **pair_kw) as pair:
        ps = prompts(11, [20, 64, 90, 130, 47])
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs)
        failed = [d for _, d in reqs if d.finish_reason is FinishReason.ABORT]
        ok = [(d, ids) for (_, d), ids in zip(reqs, ps) if d.finish_reason is not FinishReason.ABORT]
        assert failed and ok, "the seed should give both outcomes"
        assert_pd_matches([d for d, _ in ok], [ids for _, ids in ok], reference, "rooms that succeeded", route)
        pair.settle()
        check_free(pair)
        decode_abort_in_flight(pair, prompts(1, [200])[0])
        check_free(pair)


def shared_prefix_failure_waves(pair: Pair, reference: Reference) -> list[int]:
    """Two waves of prompts sharing a system prompt (the second may hit what the first cached,
    on either side) under the pair's injected write failures: the rooms that succeed give the
    colocated tokens, some fail and some succeed, and the pair settles. Returns the system prompt."""
    system = prompts(11, [40])[0]
    ps = [system + tail for tail in prompts(12, [20, 64, 90, 47, 30, 25])]
    for wave in (ps[:2], ps[2:]):
        reqs: list[tuple[Req | None, Req | None]] = [pair.reqs(ids) for ids in wave]
        pair.run(reqs)
        decodes = [d for _, d in reqs if d is not None]
        ok = [(d, ids) for d, ids in zip(decodes, wave) if d.finish_reason is not FinishReason.ABORT]
        assert_pd_matches([d for d, _ in ok], [ids for _, ids in ok], reference, "rooms that succeeded")
    st = pair.prefill.stats()["disaggregation"]
    assert st["rooms_failed"] > 0 and st["rooms_succeeded"] > 0, st
    pair.settle()
    return system


def decode_abort_in_flight(pair: Pair, ids: list[int]) -> None:
    """A request the decode aborts after one step of each side (its transfer under way); both
    sides finish it, the pair settles."""
    a = pair.reqs(ids)
    pair.prefill.add_request(a[0])
    pair.decode.add_request(a[1])
    pair.prefill.step()
    pair.decode.step()
    pair.decode.abort(a[1].rid)
    pair.run([], until=lambda: a[0].finished and a[1].finished)
    assert a[1].finish_reason is FinishReason.ABORT
    pair.settle()


def run_one(pair: Pair, ids: list[int], reference: Reference) -> tuple[int, int, Req]:
    """One request through the pair: (bytes the prefill wrote, prompt tokens the decode had cached,
    the finished decode request), its output checked against the reference."""
    before, hits = pair.sender.stats.bytes_written, pair.decode.stats()["prefix_hit_tokens"]
    p, d = pair.reqs(ids)
    pair.run([(p, d)])
    assert d.finish_reason is FinishReason.LENGTH, d.finish_detail
    assert_pd_matches([d], [ids], reference)
    return pair.sender.stats.bytes_written - before, pair.decode.stats()["prefix_hit_tokens"] - hits, d


def greedy_and_bytes_as_predicted(
    model_dir: Path,
    reference: Reference,
    chunk: int,
    groups: int,
    lens: list[int],
    check=lambda pair, stats: None,
    check_free=lambda pair: None,
    on_landed: Callable[[Pair, Req], None] | None = None,
    kv_cache_dtype: str = "auto",
) -> None:
    """Prompts of `lens` through a pair with chunked prefill of `chunk` and `groups` layer groups:
    greedy tokens and logprobs equal `reference` (assert_pd_matches), every room succeeds, the bytes
    written are pd_parity.expected_bytes, `check(pair, stats)` asserts what else the model family
    implies; then both sides settle with every page free and `check_free(pair)` checks the rest.
    `on_landed` is Pair.run's (a negative control's corruption). Both pools (and the
    reference's, which the caller builds) store `kv_cache_dtype`."""
    ps = prompts(chunk + groups, lens)
    with make_pair(model_dir, chunk, layer_groups=groups, kv_cache_dtype=kv_cache_dtype) as pair:
        reqs = [pair.reqs(ids) for ids in ps]
        pair.run(reqs, on_landed=on_landed)
        assert all(d.finish_reason is FinishReason.LENGTH for _, d in reqs), [d.finish_detail for _, d in reqs]
        assert_pd_matches([d for _, d in reqs], ps, reference)
        st = pair.prefill.stats()["disaggregation"]
        assert (st["rooms_succeeded"], st["rooms_failed"]) == (len(ps), 0)
        assert st["bytes_written"] == expected_bytes(model_dir, lens, PS, 1, 1, kv_itemsize=KV_ITEMSIZE[kv_cache_dtype])
        if groups > 1:
            assert pair.pipeline.counters.batches_by_groups.get(groups, 0) > 0
        check(pair, st)
        pair.settle()
        check_free(pair)
