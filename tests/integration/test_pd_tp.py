"""PD serving with tensor parallelism on either side (F6), through sglang-router with Mooncake over
loopback: prefill TP x decode TP = (1,2), (2,1), (2,2), (1,4), (4,1) on the tiny preset (2 KV
heads: TP 4 holds replicated heads), with chunked prefill and layer-pipelined sends. Greedy tokens
equal the colocated engine's and so do their logprobs (within fp32 all-reduce noise): a KV head
missing or misplaced on one decode rank moves them by ~1e-3 on this model while the tokens stay.
Every prefill rank's writes are counted: the bytes equal what the head-slice mapping moves. Then
a prefill TP child is killed while its room waits for the decode: the room fails on both sides
with an error naming the rank, and no page leaks. No process survives its stack."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpipe.qa.chaos import child_pids
from tests.helpers.pd_parity import check_parity as shared_check_parity
from tests.helpers.pd_parity import colocated_reference
from tests.helpers.pd_parity import prompts as parity_prompts
from tests.helpers.pd_stack import (
    TP_PS,
    Stack,
    close_and_check_no_orphans,
    disagg_stats,
    generate,
    greedy,
    pd_body,
    start_tp_stack,
    wait_for,
)
from tests.helpers.tolerance import Generation

pytest.importorskip("mooncake.engine")

PS, NEW = TP_PS, 5  # the tiny preset, fp32
LENGTHS = [300, 137, 64, 211]


def prompts() -> list[list[int]]:
    return parity_prompts(LENGTHS)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[Generation]:
    return colocated_reference(tiny_model_dir, prompts(), NEW, PS)


def check_parity(stack: Stack, model_dir: Path, reference, p_tp: int, d_tp: int, groups: int) -> None:
    shared_check_parity(stack, model_dir, prompts(), reference, NEW, PS, p_tp, d_tp, groups)


@pytest.mark.parametrize(
    "p_tp,d_tp,chunk,groups",
    [
        (1, 2, 64, 2),
        pytest.param(2, 2, 0, 1, marks=pytest.mark.slow),  # plain path, unchunked
        # replicated heads on decode: prefill writes each head twice
        pytest.param(1, 4, 48, 2, marks=pytest.mark.slow),
        # replicated heads on prefill: only one of each pair sends (make test: test_pd_tp2_to_tp1)
        pytest.param(4, 1, 64, 2, marks=pytest.mark.slow),
    ],
)
def test_pd_tp_matches_colocated(
    tiny_model_dir: Path, tmp_path: Path, reference, p_tp: int, d_tp: int, chunk: int, groups: int
) -> None:
    stack = start_tp_stack(
        tiny_model_dir,
        tmp_path,
        p_tp,
        d_tp,
        ("--chunked-prefill-size", str(chunk), "--disaggregation-layer-groups", str(groups)),
    )
    try:
        check_parity(stack, tiny_model_dir, reference, p_tp, d_tp, groups)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)


@pytest.fixture(scope="module")
def tp2_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Prefill TP 2 -> decode TP 1, chunked, 2 layer groups; its TP child gets killed last."""
    s = start_tp_stack(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-tp2"),
        2,
        1,
        ("--chunked-prefill-size", "64", "--disaggregation-layer-groups", "2"),
    )
    try:
        yield s
    finally:
        close_and_check_no_orphans(s)


def test_pd_tp2_to_tp1_matches_colocated(tp2_stack: Stack, tiny_model_dir: Path, reference) -> None:
    check_parity(tp2_stack, tiny_model_dir, reference, 2, 1, 2)


def test_prefill_tp_child_killed_fails_room_on_both_sides(tp2_stack: Stack) -> None:
    stack = tp2_stack
    before = disagg_stats(stack.prefill)
    body = pd_body(stack, {"input_ids": prompts()[0], "sampling_params": greedy(4)})
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: box.setdefault("p", httpx.post(stack.prefill.url + "/generate", json=body, timeout=60))
    )
    t.start()
    try:
        # the prompt is computed and its room is in every rank's sender, waiting for the decode
        wait_for(lambda: stack.prefill.engine_stats()["num_held"] == 1, 30, "the prefill to hold the room's pages")
        (child,) = child_pids(stack.prefill.proc.pid)
        os.kill(child, signal.SIGKILL)
    finally:
        t.join(60)
    p = box["p"]
    assert p.status_code == 500 and "TP rank 1" in p.json()["error"]["message"], p.text
    out = generate(stack.decode.url, body, timeout_s=60)  # the decode's half of the same request
    fin = out["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and "TP rank 1" in fin["message"], fin
    stack.prefill.wait_idle(30)  # no page leaked on either side
    stack.decode.wait_idle(30)
    after = disagg_stats(stack.prefill)
    assert after["rooms_failed"] == before["rooms_failed"] + 1 and after["active_rooms"] == 0
    assert stack.prefill.alive() and stack.decode.alive()
