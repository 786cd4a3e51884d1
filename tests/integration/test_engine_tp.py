"""Tensor parallelism over processes: the same greedy tokens and logprobs as tp 1 (a corrupted head
slice on one rank fails that check: negative control), clean shutdown, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvpipe.engine.errors import EngineLost
from kvpipe.engine.request import Req, SamplingParams
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.engine import assert_engine_matches, generate_after_prefill, make_engine, one_at_a_time, prompts
from tests.helpers.tolerance import Route, assert_same_generations

PROMPTS = prompts(4)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout_s=15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    try:
        return one_at_a_time(eng, PROMPTS)
    finally:
        eng.shutdown()


# tiny has 2 KV heads: tp 4 replicates them (the full sweep; PD replicates them in test_pd_tp)
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_matches_tp1(tiny_model_dir, reference, tp):
    eng = make_engine(tiny_model_dir, tp=tp, chunk=33)
    pids = [p.pid for p in eng._tp._procs]
    try:
        assert len(pids) == tp - 1
        assert eng.runner.pool.kv_heads == 1
        assert_engine_matches(eng, PROMPTS, reference, Route.ACROSS_PROCESSES)
        assert eng.stats()["tp_size"] == tp and eng.allocator.num_free == eng.allocator.num_pages
        if tp == 2:  # negative control, on the engine already running
            check_a_corrupted_head_slice_fails(eng, reference)
    finally:
        eng.shutdown()
    assert wait_gone(pids, 5.0)
    eng.shutdown()  # idempotent


def check_a_corrupted_head_slice_fails(eng, reference) -> None:
    """Rank 0's KV head (global head 0 of tiny's 2) of one page of one layer, overwritten between
    the prefill and the decode steps, makes the TP-vs-TP-1 check fail on that prompt only; the same
    paused run without the corruption passes."""
    untouched = generate_after_prefill(eng, PROMPTS, lambda e, req, i: None)
    assert_same_generations(untouched, reference, Route.ACROSS_PROCESSES, PROMPTS)
    hit = KVCorruption(layer=2, page=0, head=0)  # rank 0 runs in this process: its pool is eng.runner's
    got = generate_after_prefill(eng, PROMPTS, lambda e, req, i: i == 2 and hit.apply(e.runner.pool, req.pages))
    with pytest.raises(
        AssertionError, match=r"across processes or TP: prompt 2 \(17 tokens\): [^\n]*position [1-9][^\n]*\Z"
    ):
        assert_same_generations(got, reference, Route.ACROSS_PROCESSES, PROMPTS)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_dead_rank_fails_the_step_not_hangs(tiny_model_dir):
    eng = make_engine(tiny_model_dir, tp=2)
    try:
        child = eng._tp._procs[0]
        child.kill()
        child.wait(5)
        eng.add_request(Req("x", [5, 6, 7], SamplingParams(max_new_tokens=3)))
        with pytest.raises(EngineLost, match="TP rank 1"):  # fatal: the server exits, a supervisor restarts it
            eng.step()
        assert eng.allocator.num_free == eng.allocator.num_pages  # the failed batch freed its pages
    finally:
        eng.shutdown()


def test_children_exit_when_rank0_is_killed(tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from kvpipe.config import CacheConfig, ServerConfig
        from kvpipe.engine.engine import Engine
        eng = Engine(ServerConfig(model_path={str(tiny_model_dir)!r}, tp_size=2,
                                  cache=CacheConfig(page_size=16, num_pages=64)))
        print(" ".join(str(p.pid) for p in eng._tp._procs), flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        line = proc.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 1 and alive(pids[0])
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_gone(pids), "TP child outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
