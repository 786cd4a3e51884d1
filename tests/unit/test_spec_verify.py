"""Speculative decoding bookkeeping: draft budgets, greedy acceptance, counts, the config, and the
scheduler's verify commit with its page rollback (a fake model: the token after position q is q + 1)."""

import argparse

import numpy as np
import pytest

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.commands.flags import add_speculative_args, speculative_config_from_args
from kvpipe.config import ConfigError, SchedulerConfig, SpeculativeConfig
from kvpipe.engine.batch import ForwardMode
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.spec.verify import SpecCounts, accepted_prefix, draft_budget
from tests.helpers.scheduler_steps import check_pages, drain, req


def test_draft_budget_never_passes_max_new_tokens():
    assert draft_budget(7, max_new_tokens=100, num_output=1) == 7
    assert draft_budget(7, max_new_tokens=5, num_output=1) == 3  # 3 drafts + bonus = the 4 left
    assert draft_budget(7, max_new_tokens=5, num_output=4) == 0  # one token left: a plain decode
    assert draft_budget(0, max_new_tokens=100, num_output=1) == 0


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1  # a later match after a miss does not count
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_prefix([], [4]) == 0
    with pytest.raises(ValueError):
        accepted_prefix([5, 6], [5, 6])


def test_spec_counts():
    c = SpecCounts()
    c.add(proposed=4, accepted=3, emitted=4)
    c.add(proposed=0, accepted=0, emitted=1)
    assert (c.verify_ct, c.proposed, c.accepted, c.emitted) == (2, 4, 3, 5)
    meta = c.meta_info()
    assert meta["spec_verify_ct"] == 2 and meta["spec_accept_length"] == 2.5 and meta["spec_accept_rate"] == 0.75


def test_config_and_flags():
    assert not SpeculativeConfig().enabled and SpeculativeConfig().max_drafts == 0
    assert SpeculativeConfig("NGRAM").max_drafts == 7
    assert SpeculativeConfig("NGRAM", num_steps=3).max_drafts == 3
    assert SpeculativeConfig("NGRAM", num_draft_tokens=5, num_steps=4, eagle_topk=1).max_drafts == 4
    assert SpeculativeConfig("STANDALONE", draft_model_path="d").max_drafts == 3
    assert SpeculativeConfig("STANDALONE", num_steps=5, draft_model_path="d").max_drafts == 5
    assert SpeculativeConfig("NEXTN").max_drafts == 3 and SpeculativeConfig("NEXTN").uses_mtp
    assert SpeculativeConfig("EAGLE", num_steps=2).uses_mtp and not SpeculativeConfig("NGRAM").uses_mtp
    for bad in (
        dict(algorithm="EAGLE3"),
        dict(algorithm="NEXTN", draft_model_path="d"),  # the MTP layer is the target checkpoint's
        dict(algorithm="STANDALONE"),  # without a draft model
        dict(algorithm="NGRAM", draft_model_path="d"),
        dict(algorithm="MEDUSA"),
        dict(algorithm="NGRAM", eagle_topk=4),
        dict(algorithm="NGRAM", num_steps=3, num_draft_tokens=8),
        dict(algorithm="NGRAM", num_draft_tokens=0),
        dict(algorithm="NGRAM", ngram_min_match_window_size=5, ngram_max_match_window_size=2),
    ):
        with pytest.raises(ConfigError):
            SpeculativeConfig(**bad)
    with pytest.raises(ConfigError, match="not implemented yet"):
        SpeculativeConfig("EAGLE3")
    p = argparse.ArgumentParser()
    add_speculative_args(p)
    cfg = speculative_config_from_args(
        p.parse_args(
            "--speculative-algorithm ngram --speculative-num-draft-tokens 5 "
            "--speculative-ngram-max-match-window-size 6".split()
        )
    )
    assert cfg == SpeculativeConfig("NGRAM", num_draft_tokens=5, ngram_max_match_window_size=6)
    assert not speculative_config_from_args(p.parse_args([])).enabled
    args = p.parse_args("--speculative-algorithm standalone --speculative-draft-model-path /m/draft".split())
    assert speculative_config_from_args(args) == SpeculativeConfig("STANDALONE", draft_model_path="/m/draft")
    # EAGLE with a draft model path: an EAGLE head (engine/spec/eagle_drafter.py), drafted like NEXTN
    args = p.parse_args("--speculative-algorithm EAGLE --speculative-draft-model-path /m/head".split())
    eagle = speculative_config_from_args(args)
    assert eagle.uses_mtp and eagle.eagle_head_path == "/m/head" and eagle.standalone_draft_path is None
    assert eagle.max_drafts == 3 and SpeculativeConfig("EAGLE").eagle_head_path is None


def _fake_drafter(wrong_at: int):
    """Drafts the fake model's tokens (the token after a sequence of n tokens is n), wrong from
    draft `wrong_at` on."""

    def propose(r: Req, k: int) -> list[int]:
        return [r.seq_len + i if i < wrong_at else 10_000 + i for i in range(k)]

    return propose


def _done(r: Req) -> bool:
    return len(r.output_ids) >= r.params.max_new_tokens


def _verify_drain(s: Scheduler, limit: int = 1000) -> list:
    """Drain with the fake model; decode rows verify their drafts through commit_verify."""
    batches = []
    for _ in range(limit):
        b = s.schedule()
        if b is None:
            return batches
        check_pages(s, b)
        batches.append(b)
        if b.mode is ForwardMode.PREFILL:
            toks = [r.seq_len if b.completes_prefill(i) else None for i, r in enumerate(b.reqs)]
            s.commit(b, toks, [0.0] * len(toks))
            for r, t in zip(b.reqs, toks):
                if t is not None and len(r.output_ids) >= r.params.max_new_tokens:
                    s.finish(r, FinishReason.LENGTH)
            continue
        for i, r in enumerate(b.reqs):
            draft, pre = b.drafts[i], b.prefix_lens[i]
            assert b.extend_lens[i] == 1 + len(draft) and pre == r.seq_len - 1
            targets = [pre + 1 + j for j in range(len(draft) + 1)]  # the token after position q is q + 1
            a = accepted_prefix(draft, targets)
            n = s.commit_verify(
                r, pre, targets[: a + 1], [0.0] * (a + 1), lambda q: len(q.output_ids) >= q.params.max_new_tokens
            )
            assert r.num_cached == r.seq_len - 1 == pre + n
            assert len(r.pages) == max(-(-r.num_cached // s.page_size), r.num_shared_pages)  # rolled back
            if len(r.output_ids) >= r.params.max_new_tokens:
                s.finish(r, FinishReason.LENGTH)
        owned = np.concatenate([r.pages[r.num_shared_pages :] for r in s.running] or [np.zeros(0, np.int64)])
        assert owned.size + (s.cache.num_pages if s.cache else 0) == s.allocator.num_used
    raise AssertionError("did not drain")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("wrong_at", [0, 2, 100])
def test_verify_commit_emits_what_plain_decoding_does_and_rolls_back(page_size, wrong_at):
    lens, max_new = [3, 10, 17], [9, 1, 20]
    plain = Scheduler(SchedulerConfig(), PageAllocator(256), page_size, 4096)
    spec = Scheduler(
        SchedulerConfig(), PageAllocator(256), page_size, 4096, drafter=_fake_drafter(wrong_at), max_drafts=4
    )
    ref = [req(f"r{i}", n, max_new=m) for i, (n, m) in enumerate(zip(lens, max_new))]
    got = [req(f"r{i}", n, max_new=m) for i, (n, m) in enumerate(zip(lens, max_new))]
    for a, b in zip(ref, got):
        plain.add(a)
        spec.add(b)
    drain(plain)
    batches = _verify_drain(spec)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert all(len(r.output_ids) == m for r, m in zip(got, max_new))
    assert spec.allocator.num_free == 256
    decode = [b for b in batches if b.mode is ForwardMode.DECODE]
    drafted = sum(len(d) for b in decode for d in b.drafts)
    assert drafted > 0
    # all drafts right: each step emits up to 5 tokens, so fewer decode steps than plain decoding
    if wrong_at == 100:
        assert len(decode) < sum(m - 1 for m in max_new) / 2


def test_rollback_keeps_cached_prefix_pages_and_the_cache_gets_only_accepted_kv():
    cache = RadixCache(4)
    s = Scheduler(
        SchedulerConfig(), PageAllocator(64), 4, 4096, prefix_cache=cache, drafter=_fake_drafter(1), max_drafts=6
    )
    first = Req("a", list(range(1, 13)), SamplingParams(max_new_tokens=9))
    s.add(first)
    _verify_drain(s)
    # the cache holds the pages of the tokens whose KV was computed and accepted, nothing past them
    assert cache.num_pages == (len(first.all_ids) - 1) // 4
    second = Req("b", first.all_ids[:-1] + [77], SamplingParams(max_new_tokens=6))
    s.add(second)
    _verify_drain(s)
    assert second.cached_tokens == 20  # the shared pages were never rolled back
    assert s.allocator.num_free + cache.evictable_pages == 64 and cache.locked_pages == 0
