"""Prefix caching with PD (in one process over the `local` backend, both engines stepped from the
test thread): the prefill skips computing its cached prefix, the decode asks only for the KV past
its own cached prefix. Greedy outputs (tokens and logprobs) equal the colocated engine without any
cache, and a corrupted cached page fails that check (negative control); transferred bytes are
bounded by the unique suffix; failures and aborts never touch shared pages."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest

from kvpipe.config import FaultInjection
from kvpipe.engine.request import FinishReason, Req
from kvpipe.model.presets import write_preset
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.pd_pair import GREEDY, PS, Pair, Reference, assert_pd_matches, colocated_greedy, make_pair
from tests.helpers.prefix_prompts import shared_prefix_prompts


def pair_caches(pair: Pair) -> tuple[bool, bool]:
    return pair.prefill.prefix_cache is not None, pair.decode.prefix_cache is not None


def run_waves(pair: Pair, waves: list[list[list[int]]], reference: Reference) -> list[Req]:
    """Each wave runs concurrently after the previous one finished (so later waves can hit); each
    wave's tokens and logprobs equal the colocated reference's (the message names the wave)."""
    done = []
    for k, wave in enumerate(waves):
        reqs = [pair.reqs(ids) for ids in wave]
        pair.run(reqs)
        assert all(p.finish_reason is FinishReason.LENGTH for p, _ in reqs), [p.finish_detail for p, _ in reqs]
        assert_pd_matches([d for _, d in reqs], wave, reference, f"wave {k}")
        done += [d for _, d in reqs]
    return done


@pytest.mark.parametrize(
    "prefill_cache,decode_cache,chunk,groups",
    [
        (True, True, 24, 1),  # 24 does not divide pages of 16
        (True, True, 0, 3),  # layer-pipelined sends
        (False, True, 24, 3),
        (True, False, 0, 1),
    ],
)
def test_greedy_equals_no_cache(tiny_model_dir, reference, prefill_cache, decode_cache, chunk, groups):
    ps = shared_prefix_prompts(1)
    first = ps[::8]  # one prompt per prefix fills the caches
    rest = [p for i, p in enumerate(ps) if i % 8]
    with make_pair(
        tiny_model_dir, chunk, layer_groups=groups, decode_radix_cache=decode_cache, prefill_radix_cache=prefill_cache
    ) as pair:
        assert pair_caches(pair) == (prefill_cache, decode_cache)
        done = run_waves(pair, [first, rest[:14], rest[14:]], reference)
        # a multi-turn conversation: each turn resends the previous prompt and answer
        convo = ps[3]
        for turn in range(3):
            convo = convo + list(reference(convo).tokens) + [5 + turn] * (turn + 3)
            done += run_waves(pair, [[convo]], reference)
        p_hits = pair.prefill.stats()["prefix_hit_tokens"]
        d_hits = pair.decode.stats()["prefix_hit_tokens"]
        assert (p_hits > 0) == prefill_cache and (d_hits > 0) == decode_cache
        if prefill_cache:  # the decode reports what the prefill did not compute
            assert any(d.cached_tokens > 0 for d in done)
        assert all(d.cached_tokens % PS == 0 for d in done)
        pair.settle()


def test_a_corrupted_cached_page_fails_the_check(tiny_model_dir, reference):
    """Negative control: one page the decode's prefix cache holds (the first page of the 16-token
    prefix, one layer), overwritten after the wave that cached it, makes the next wave's check fail
    on the prompts that reuse that page, and on those only; a wave that runs before it passes."""
    ps = shared_prefix_prompts(1)
    with make_pair(tiny_model_dir, 24, decode_radix_cache=True, prefill_radix_cache=False) as pair:
        run_waves(pair, [ps[::8], [ps[4], ps[9], ps[10]]], reference)  # caches every prefix; then hits
        assert pair.decode.prefix_cache is not None
        pages, _ = pair.decode.prefix_cache.match(ps[0])
        assert len(pages) >= 1
        KVCorruption(layer=1, page=0).apply(pair.decode.runner.pool, pages)
        wave = ps[1:4] + ps[12:14]  # three prompts on the corrupted prefix, two on another
        with pytest.raises(
            AssertionError, match=r"(?s)wave 0: same process and TP: prompt 0 .*prompt 2 \([^\n]*\Z"
        ) as err:
            run_waves(pair, [wave], reference)
        assert "prompt 3" not in str(err.value) and "prompt 4" not in str(err.value)
        pair.settle()


def test_transferred_bytes_at_most_suffix_plus_one_page(tiny_model_dir, reference):
    """With the decode cache the prefill writes only the pages past the decode's prefix."""
    rnd = random.Random(5)
    base = [rnd.randrange(3, 290) for _ in range(100)]
    with make_pair(tiny_model_dir, 24, decode_radix_cache=True) as pair:
        token_nbytes = pair.layout.token_nbytes

        def written(ids: list[int]) -> tuple[int, int]:
            """(KV bytes the prefill wrote, prompt tokens the decode had cached) for one request."""
            before, hits = pair.sender.stats.bytes_written, pair.decode.stats()["prefix_hit_tokens"]
            run_waves(pair, [[ids]], reference)
            return pair.sender.stats.bytes_written - before, pair.decode.stats()["prefix_hit_tokens"] - hits

        full, _ = written(base)
        assert full >= len(base) * token_nbytes  # nothing cached yet: the whole prompt
        for keep, extra in ((80, 30), (64, 1), (99, 17), (40, 60)):
            ids = base[:keep] + [rnd.randrange(3, 290) for _ in range(extra)]
            n, hit = written(ids)
            held = (min(keep, len(ids) - 1) // PS) * PS  # the decode's cached prefix (page aligned)
            suffix = len(ids) - held
            assert n <= (suffix + PS) * token_nbytes, (keep, extra, n, suffix)
            assert n < full or suffix >= len(base)
            assert hit == held
        pair.settle()


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    """tiny-deepseek-v3 (MLA latent KV cache, sparse MoE) and its colocated greedy reference."""
    model_dir = write_preset("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny-deepseek-v3"))
    gen = colocated_greedy(model_dir)
    yield model_dir, next(gen)
    gen.close()


def test_mla_decode_prefix_reuse_moves_only_the_suffix_in_layer_groups(mla_model):
    """Prefix reuse and layer-pipelined sends work unchanged on a latent KV pool: greedy equals
    colocated, and the prefill writes only the latent pages past the decode's cached prefix."""
    model_dir, ref = mla_model
    rnd = random.Random(6)
    base = [rnd.randrange(3, 290) for _ in range(90)]
    with make_pair(model_dir, 24, decode_radix_cache=True, layer_groups=2) as pair:
        assert pair.layout.latent and pair.layout.buffers_per_layer == 1
        token_nbytes = pair.layout.token_nbytes  # layers * (kv_lora_rank + rope) * 4
        before = pair.sender.stats.bytes_written
        run_waves(pair, [[base]], ref)
        assert pair.sender.stats.bytes_written - before == -(-len(base) // PS) * PS * token_nbytes
        for keep, extra in ((80, 30), (64, 1), (37, 50)):
            ids = base[:keep] + [rnd.randrange(3, 290) for _ in range(extra)]
            before, hits = pair.sender.stats.bytes_written, pair.decode.stats()["prefix_hit_tokens"]
            run_waves(pair, [[ids]], ref)
            held = (min(keep, len(ids) - 1) // PS) * PS
            assert pair.decode.stats()["prefix_hit_tokens"] - hits == held
            sent = pair.sender.stats.bytes_written - before
            assert sent == -(-(len(ids) - held) // PS) * PS * token_nbytes, (keep, extra, sent)
        assert pair.prefill.stats()["layer_group_batches"], pair.prefill.stats()
        pair.settle()


def test_failures_and_aborts_spare_shared_pages(tiny_model_dir, reference):
    """Injected transfer failures and client aborts of requests sharing a cached prefix free only
    their own pages: the prefix still serves later requests exactly, and every page comes back."""
    rnd = random.Random(9)
    prefix = [rnd.randrange(3, 290) for _ in range(70)]

    def prompt() -> list[int]:
        return prefix + [rnd.randrange(3, 290) for _ in range(rnd.randint(1, 30))]

    with make_pair(tiny_model_dir, 24, inject=FaultInjection(prob=0.3, seed=4), decode_radix_cache=True) as pair:
        run_waves_allowing_failures(pair, [prompt() for _ in range(3)], reference)
        ids = [prompt() for _ in range(12)]
        reqs = [pair.reqs(x) for x in ids]
        for p, d in reqs:
            pair.prefill.add_request(p)
            pair.decode.add_request(d)
        pair.decode.step()
        pair.decode.abort(reqs[0][1].rid)  # aborted right after it reserved (prefix pinned)
        pair.prefill.abort(reqs[1][0].rid)  # aborted on the prefill before its forward
        pair.run([], until=lambda: all(p.finished and d.finished for p, d in reqs))
        failed = [d for _, d in reqs if d.finish_reason is FinishReason.ABORT]
        assert len(failed) >= 2
        ok = [(d, x) for (_, d), x in zip(reqs, ids) if d.finish_reason is not FinishReason.ABORT]
        assert_pd_matches([d for d, _ in ok], [x for _, x in ok], reference, "requests that finished")
        pair.settle()
        assert pair.decode.stats()["cached_pages"] > 0
    with make_pair(tiny_model_dir, 24, decode_radix_cache=True) as pair:  # no failures: all exact
        run_waves(pair, [[prompt() for _ in range(2)], [prompt() for _ in range(6)]], reference)
        pair.settle()


def run_waves_allowing_failures(pair: Pair, ids: list[list[int]], reference: Reference) -> None:
    reqs = [pair.reqs(x) for x in ids]
    pair.run(reqs)
    ok = [(d, x) for (_, d), x in zip(reqs, ids) if d.finish_reason is not FinishReason.ABORT]
    assert_pd_matches([d for d, _ in ok], [x for _, x in ok], reference, "requests that finished")


def test_soak_under_memory_pressure(tiny_model_dir, reference):
    """Pools that force eviction on both sides, shared prefixes, 10% client aborts and 5% injected
    transfer failures; every finished output is exact and every page is free (or evictable) at
    the end. 40 requests here; KVPIPE_SOAK_REQUESTS=500 runs the full soak (docs/benchmarks.md)."""
    num_requests = int(os.environ.get("KVPIPE_SOAK_REQUESTS", "40"))
    rnd = random.Random(21)
    prefixes = [[rnd.randrange(3, 290) for _ in range(n)] for n in (48, 75, 100)]
    params = replace(GREEDY, max_new_tokens=4)
    # a decode-side abort of a request still waiting for decode pages never reaches the prefill,
    # which then holds its pages until the bootstrap timeout: keep that short here
    with make_pair(
        tiny_model_dir,
        32,
        p_pages=24,
        d_pages=24,
        inject=FaultInjection(prob=0.05, seed=8),
        decode_radix_cache=True,
        bootstrap_timeout_s=2.0,
    ) as pair:
        counts = {"ok": 0, "aborted": 0}
        for _ in range(-(-num_requests // 10)):
            ids = [rnd.choice(prefixes) + [rnd.randrange(3, 290) for _ in range(rnd.randint(1, 60))] for _ in range(10)]
            reqs = [pair.reqs(x, params) for x in ids]
            for p, d in reqs:
                pair.prefill.add_request(p)
                pair.decode.add_request(d)
            for _, d in reqs:
                if rnd.random() < 0.1:
                    (pair.decode if rnd.random() < 0.5 else pair.prefill).abort(d.rid)
            pair.run([], until=lambda reqs=reqs: all(p.finished and d.finished for p, d in reqs), timeout_s=120)
            ok = [(d, x) for (_, d), x in zip(reqs, ids) if d.finish_reason is not FinishReason.ABORT]
            assert_pd_matches([d for d, _ in ok], [x for _, x in ok], reference, "requests that finished")
            counts["ok"] += len(ok)
            counts["aborted"] += len(reqs) - len(ok)
        assert pair.decode.stats()["prefix_hit_tokens"] > 0
        pair.settle()
        print(f"soak: {counts}, prefill {pair.prefill.stats()}, decode {pair.decode.stats()}")
