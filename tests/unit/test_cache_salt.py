"""Per-tenant prefix isolation (issue 45, finding 8) in the scheduler without a model: a prompt
cached under one `cache_salt` is a hit for the same salt only, never for another salt nor for an
unsalted request (and an unsalted one only for unsalted ones), with each prefix cache (plain
radix, sliding-window, hybrid with state snapshots) and on a PD decode's reserve; pages stay each
one's own or the cache's."""

from __future__ import annotations

import pytest

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache, salted
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import SchedulerConfig
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.engine.scheduler import Scheduler
from tests.helpers.scheduler_steps import step

PS = 4
PROMPT = list(range(1, 4 * PS + 2))  # four whole pages and a token


def _plain() -> Scheduler:
    return Scheduler(SchedulerConfig(), PageAllocator(64), PS, 4096, prefix_cache=RadixCache(PS))


def _window() -> Scheduler:
    return Scheduler(SchedulerConfig(), PageAllocator(64), PS, 4096, prefix_cache=SWARadixCache(PS, 64), window=64)


def _hybrid() -> Scheduler:
    cache = HybridRadixCache(PS, StateSlotAllocator(6, first=2), True)
    cfg = SchedulerConfig(max_running_requests=2)
    return Scheduler(cfg, PageAllocator(64), PS, 4096, prefix_cache=cache, state_slots=StateSlotAllocator(2))


def _run(s: Scheduler, rid: str, salt: str | None) -> int:
    """Serve one request of PROMPT to the end; its cached tokens."""
    r = Req(rid, list(PROMPT), SamplingParams(max_new_tokens=2), cache_salt=salt)
    assert s.add(r)
    for _ in range(100):  # (check=False: step's page check counts no cache's pages)
        if step(s, check=False) is None:
            return r.cached_tokens
    raise AssertionError("the scheduler did not drain")


@pytest.mark.parametrize("make", [_plain, _window, _hybrid], ids=["radix", "sliding-window", "hybrid"])
def test_a_prefix_is_shared_only_within_its_salt(make) -> None:  # type: ignore[no-untyped-def]
    s = make()
    assert _run(s, "a1", "tenant-a") == 0
    assert _run(s, "b1", "tenant-b") == 0  # the same prompt, another tenant: nothing to learn
    assert _run(s, "u1", None) == 0  # nor for an unsalted request
    hit = _run(s, "a2", "tenant-a")
    assert hit > 0 and _run(s, "b2", "tenant-b") == hit and _run(s, "u2", None) == hit
    assert s.allocator.num_used == s.pages.cached_pages()  # every page is the cache's: none leaked


def test_a_pd_decode_reserves_past_its_own_salt_s_prefix_only() -> None:
    s = _plain()
    _run(s, "a1", "tenant-a")
    for salt, expect_hit in (("tenant-b", False), (None, False), ("tenant-a", True)):
        r = Req(f"d-{salt}", list(PROMPT), SamplingParams(max_new_tokens=2), cache_salt=salt)
        assert s.reserve(r)
        assert (r.num_shared_pages > 0) is expect_hit, (salt, r.num_shared_pages)
        s.finish(r, FinishReason.ABORT)
    assert s.allocator.num_used == s.pages.cached_pages()


def test_salted_keys() -> None:
    ids = [0, 1, 2**31 - 1]
    assert salted(ids, None) is ids
    a, b = salted(ids, "a"), salted(ids, "b")
    assert a != b and not set(a) & set(ids) and not set(a) & set(b)
    assert [t & (2**32 - 1) for t in a] == ids and salted(ids, "a") == a  # stable, the ids kept below
