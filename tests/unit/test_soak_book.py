"""The soak's pure parts: the seeded plan, the outcome tally and its checks, the pool leak checks
against a baseline, resource deltas and bounds, and /proc parsing on a fake /proc tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Api, Request
from kvpipe.qa.checks import verdict
from kvpipe.qa.leaks import pool_checks
from kvpipe.qa.soak_plan import Bounds, SoakConfig, plan_requests, plan_warmup
from kvpipe.qa.soak_procs import ProcSample, group_pids, sample_group
from kvpipe.qa.soak_report import room_deltas
from kvpipe.qa.soak_resources import ResourceSeries, resource_checks
from kvpipe.qa.soak_tally import Tally


def test_plan_is_seeded_mixed_and_within_bounds() -> None:
    cfg = SoakConfig(num_requests=400, prompt_min=5, prompt_max=300, disconnect_prob=0.2, seed=3)
    plan = plan_requests(cfg)
    assert plan == plan_requests(cfg) and plan != plan_requests(SoakConfig(num_requests=400, seed=4))
    assert [r.index for r in plan] == list(range(400))
    assert {r.api for r in plan} == set(Api) and {r.stream for r in plan} == {True, False}
    assert all(5 <= r.prompt_len <= 300 for r in plan)
    ids = [r for r in plan if not isinstance(r.prompt, str)]
    assert ids and all(r.api is Api.GENERATE for r in ids)
    assert all(r.prompt.strip() for r in plan if isinstance(r.prompt, str))
    cut = [r for r in plan if r.disconnect_after is not None]
    assert 40 <= len(cut) <= 120  # 20% of 400, loosely
    assert all(r.stream and r.max_tokens > r.disconnect_after for r in cut)
    assert all(1 <= r.max_tokens <= cfg.output_max for r in plan if r.disconnect_after is None)


def test_warmup_starts_with_the_longest_prompts_at_full_concurrency() -> None:
    cfg = SoakConfig(num_requests=50, concurrency=6, prompt_min=10, prompt_max=900, warmup_requests=8)
    warm = plan_warmup(cfg)
    assert [r.index for r in warm] == list(range(14))
    assert all(r.prompt_len == 900 for r in warm[:6]) and all(10 <= r.prompt_len <= 900 for r in warm[6:])
    assert [r.prompt for r in warm] != [r.prompt for r in plan_requests(cfg)[:14]]
    assert plan_warmup(SoakConfig(warmup_requests=0)) == []


def test_bodies_per_kind() -> None:
    plan = plan_requests(SoakConfig(num_requests=60, prompt_max=20))
    for r in plan:
        b = r.body("m")
        if r.api is Api.GENERATE:
            assert b["sampling_params"]["max_new_tokens"] == r.max_tokens and b["sampling_params"]["ignore_eos"]
            assert ("input_ids" in b) == (not isinstance(r.prompt, str))
        else:
            assert b["model"] == "m" and b["max_tokens"] == r.max_tokens
            assert ("messages" in b) == (r.api is Api.CHAT) and ("prompt" in b) == (r.api is Api.COMPLETION)
            assert ("stream_options" in b) == r.stream


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_requests=0),
        dict(prompt_min=0),
        dict(prompt_min=9, prompt_max=8),
        dict(failure_prob=1.5),
        dict(deadline_s=0),
        dict(disconnect_output=2),
    ],
)
def test_config_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        SoakConfig(**bad)


def _res(
    i: int, end: End, api: Api = Api.GENERATE, status: int | None = 200, msg: str = "", latency: float = 0.1
) -> Outcome:
    req = Request(i, "abc", 4, api, stream=i % 2 == 0)
    return Outcome(req, end, 1.0, 1.0 + latency, 3, http_status=status, message=msg, reason=msg)


def test_tally_counts_and_latency() -> None:
    t = Tally()
    for i, e in enumerate([End.OK] * 3 + [End.HTTP_ERROR, End.DISCONNECTED]):
        t.add(
            _res(
                i,
                e,
                Api.CHAT if i == 4 else Api.GENERATE,
                500 if e is End.HTTP_ERROR else 200,
                "HTTP 500: KV transfer failed" if e is End.HTTP_ERROR else "",
                latency=0.1 * (i + 1),
            )
        )
    assert t.by_outcome() == {"success": 3, "error": 1, "disconnected": 1, "unclear": 0, "hang": 0}
    assert t.by_kind()["chat/stream"]["disconnected"] == 1
    assert t.by_kind()["generate/plain"]["success"] == 1 and t.by_kind()["generate/stream"]["success"] == 2
    assert t.latency_ms()["success"]["p50"] == pytest.approx(200.0)
    assert t.messages() == [{"outcome": "error", "status": 500, "message": "HTTP 500: KV transfer failed", "count": 1}]
    assert verdict(t.checks(5, faults_injected=True))
    failed = {c.name for c in t.checks(5, faults_injected=False) if not c.ok}
    assert failed == {"no 5xx without injected faults"}


def test_tally_checks_fail_on_hang_unclear_missing_and_duplicates() -> None:
    t = Tally()
    t.add(_res(0, End.TIMEOUT, status=None))
    t.add(_res(1, End.CONNECTION, status=None, msg="RemoteProtocolError"))
    t.add(_res(1, End.OK))
    failed = {c.name for c in t.checks(3, faults_injected=True) if not c.ok}
    assert failed == {"no hangs", "every request accounted"}  # the duplicate replaced the unclear one
    t2 = Tally()
    t2.add(_res(0, End.CUT, status=None))
    assert {c.name for c in t2.checks(1, True) if not c.ok} == {"every failure is clear"}


def _stats(**kw: object) -> dict:
    s = {
        "num_running": 0,
        "num_waiting": 0,
        "num_reserved": 0,
        "num_held": 0,
        "free_pages": 100,
        "total_pages": 100,
        "disaggregation": {
            "active_rooms": 0,
            "transfer_rooms": 0,
            "staging_ring": {"live_slots": 0, "used_bytes": 0, "waiting": 0},
        },
    }
    for k, v in kw.items():
        if k in s:
            s[k] = v
        else:
            s["disaggregation"][k] = v
    return s


def test_pool_checks_find_leaks() -> None:
    base = _stats()
    assert verdict(pool_checks("decode", _stats(), base))
    leaked = pool_checks("decode", _stats(free_pages=96, active_rooms=1, transfer_rooms=2, num_reserved=1), base)
    assert {c.name for c in leaked if not c.ok} == {
        "decode free_pages",
        "decode disaggregation.active_rooms",
        "decode disaggregation.transfer_rooms",
        "decode num_reserved",
    }
    ring = _stats()
    ring["disaggregation"]["staging_ring"]["live_slots"] = 2
    failed = [c.name for c in pool_checks("decode", ring, base) if not c.ok]
    assert failed == ["decode disaggregation.staging_ring.live_slots"]
    # without a baseline: the zero and full rules on what the server reports now
    assert verdict(pool_checks("decode", ring))
    assert {c.name for c in pool_checks("decode", _stats(num_running=1, free_pages=99)) if not c.ok} == {
        "decode num_running",
        "decode free_pages",
    }
    # what a server does not report is not checked; a key it stopped reporting is a failure
    assert [c.name for c in pool_checks("x", {"num_running": 0}, {"num_running": 0})] == ["x num_running"]
    assert not verdict(pool_checks("x", {}, {"num_running": 0}))


def test_room_deltas() -> None:
    base, final = _stats(rooms_succeeded=32, rooms_failed=1), _stats(rooms_succeeded=1032, rooms_failed=247)
    assert room_deltas(base, final) == {"rooms_succeeded": 1000, "rooms_failed": 246}
    assert room_deltas({}, final) == {"rooms_succeeded": None, "rooms_failed": None}


def _sample(t: float, rss_mb: float, fds: int = 50, threads: int = 20, procs: int = 1) -> ProcSample:
    return ProcSample(t, int(rss_mb * 1024), fds, threads, procs)


def test_resource_deltas_and_bounds() -> None:
    s = ResourceSeries(_sample(0, 500), [_sample(1, 700), _sample(2, 520)], _sample(3, 530, fds=53, threads=21))
    assert s.deltas() == {
        "rss_mb": 30.0,
        "peak_rss_growth_mb": 200.0,
        "rss_second_half_mb": 10.0,
        "fds": 3,
        "threads": 1,
        "procs": 0,
    }
    assert s.to_dict()["during"][0] == [1, 700.0, 50, 20, 1]
    assert verdict(resource_checks("prefill", s, Bounds(rss_growth_mb=64, fd_delta=4, thread_delta=2)))
    failed = {
        c.name for c in resource_checks("prefill", s, Bounds(rss_growth_mb=20, fd_delta=2, thread_delta=0)) if not c.ok
    }
    assert failed == {"prefill RSS growth", "prefill open fds", "prefill threads"}
    # a warm-up of fewer requests than the load's concurrency: one keep-alive connection each may come
    tight = Bounds(rss_growth_mb=64, fd_delta=2, thread_delta=2)
    assert not verdict(resource_checks("prefill", s, tight, unwarmed=0))
    assert verdict(resource_checks("prefill", s, tight, unwarmed=1))
    assert not verdict(resource_checks("prefill", s, tight, unwarmed=-5))  # more warm-up than slots: no less
    fewer = ResourceSeries(_sample(0, 500, fds=47, threads=13), [], _sample(1, 500, fds=38, threads=12))
    assert verdict(resource_checks("decode", fewer, Bounds()))  # closed keep-alive sockets are no leak
    gone = ResourceSeries(_sample(0, 500), [], None)
    assert not verdict(resource_checks("decode", gone, Bounds()))
    lost_rank = ResourceSeries(_sample(0, 500, procs=2), [], _sample(1, 500, procs=1))
    assert [c.name for c in resource_checks("d", lost_rank, Bounds()) if not c.ok] == ["d processes"]


def _fake_proc(root: Path, pid: int, pgid: int, comm: str, rss_kb: int, threads: int, fds: int) -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    # state ppid pgrp ...; the command name may hold spaces and parentheses
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {pgid} {pgid} 0 -1 4194560 0 0\n")
    (d / "status").write_text(f"Name:\t{comm}\nVmRSS:\t{rss_kb} kB\nThreads:\t{threads}\n")
    for i in range(fds):
        (d / "fd" / str(i)).write_text("")


def test_proc_group_sample_sums_the_group(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 100, 100, "python", 1000, 10, 7)
    _fake_proc(tmp_path, 101, 100, "tp (rank) 1", 500, 4, 3)  # a TP worker in the same group
    _fake_proc(tmp_path, 200, 200, "router", 9999, 99, 99)
    (tmp_path / "self").mkdir()
    assert group_pids(100, tmp_path) == [100, 101]
    s = sample_group(100, 1.5, tmp_path)
    assert s == ProcSample(1.5, 1500, 10, 14, 2)
    assert sample_group(300, 0.0, tmp_path) is None
