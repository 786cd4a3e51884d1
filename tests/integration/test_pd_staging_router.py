"""Heterogeneous-TP PD through the staging ring, end to end: sglang-router, Mooncake over loopback,
`--disaggregation-staging-buffer on` with a 1 MB ring, prefill TP x decode TP = (1,2), (1,4),
(4,1) on a tiny model with 4 KV heads (so every pairing slices heads), chunked and not,
layer-pipelined and not. Greedy tokens equal the colocated engine's, logprobs
within fp32 all-reduce noise; every prefill write is a staged chunk (one op each) and the bytes
equal what the head-slice mapping moves; afterwards every page and staging slot is free."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpipe.model.presets import write_preset
from tests.helpers.pd_parity import KV_ITEMSIZE, ROUTE, colocated_reference, expected_bytes
from tests.helpers.pd_stack import close_and_check_no_orphans, disagg_stats, generate, greedy, start_tp_stack
from tests.helpers.tolerance import Generation, assert_same_generations

pytest.importorskip("mooncake.engine")

PS, NEW = 16, 5  # tiny-kv4 (4 KV heads), fp32
LENGTHS = [300, 137, 64, 211]


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 290) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def kv4_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset("tiny-kv4", tmp_path_factory.mktemp("tiny_kv4"))


@pytest.fixture(scope="module")
def reference(kv4_model_dir: Path) -> list[Generation]:
    return colocated_reference(kv4_model_dir, prompts(), NEW, PS)


# both directions, TP 4 on either side (decode TP 4 in the full sweep), chunked and not,
# layer-pipelined and not (the other pairings' slicing is covered by
# tests/integration/test_staging_transfer.py without a router)
# fp8 K/V (issue 26): 1-byte elements through the ring's gather and scatter, whole prompts (a
# chunk reads the rounded KV of the earlier ones, and concurrent requests do not fix chunk
# boundaries), against colocated with the same KV dtype
@pytest.mark.parametrize(
    "p_tp,d_tp,chunk,groups,kv",
    [
        (1, 2, 64, 2, "auto"),
        pytest.param(1, 4, 0, 2, "auto", marks=pytest.mark.slow),
        (4, 1, 48, 1, "auto"),
        (1, 2, 0, 2, "fp8_e4m3"),
    ],
)
def test_staged_pd_matches_colocated(
    kv4_model_dir: Path, tmp_path: Path, reference, p_tp: int, d_tp: int, chunk: int, groups: int, kv: str
) -> None:
    if kv != "auto":
        reference = colocated_reference(kv4_model_dir, prompts(), NEW, PS, kv, chunk=0)
    stack = start_tp_stack(
        kv4_model_dir,
        tmp_path,
        p_tp,
        d_tp,
        (
            "--chunked-prefill-size",
            str(chunk),
            "--disaggregation-layer-groups",
            str(groups),
            "--disaggregation-staging-buffer",
            "on",
            "--disaggregation-staging-pool-size-mb",
            "1",
            "--kv-cache-dtype",
            kv,
        ),
    )
    try:

        def one(ids: list[int]) -> dict:
            return generate(stack.router, {"input_ids": ids, "sampling_params": greedy(NEW), "return_logprob": True})

        with ThreadPoolExecutor(len(LENGTHS)) as pool:  # concurrent: chunks of several rooms share the ring
            outs = list(pool.map(one, prompts()))
        assert_same_generations([Generation.of(o) for o in outs], reference, ROUTE, prompts(), "staged")
        stack.prefill.wait_idle(30)
        stack.decode.wait_idle(30)
        st = disagg_stats(stack.prefill)
        assert (st["rooms_succeeded"], st["rooms_failed"]) == (len(LENGTHS), 0), st
        assert (
            st["bytes_written"]
            == st["staged_bytes"]
            == expected_bytes(kv4_model_dir, LENGTHS, PS, p_tp, d_tp, kv_itemsize=KV_ITEMSIZE[kv])
        ), st
        assert st["ops_submitted"] == st["staged_chunks"] > 0, st  # every write one staged chunk
        ring = disagg_stats(stack.decode)["staging_ring"]  # decode rank 0's
        assert ring["live_slots"] == ring["waiting"] == 0 and ring["scattered"] == ring["granted"] > 0, ring
        # kvpipe_staging_wait_seconds (issue 29): one wait per grant, at scrape time
        assert stack.decode.metric("kvpipe_staging_wait_seconds_count") == ring["granted"]
    except BaseException:
        print(stack.logs())
        raise
    finally:
        close_and_check_no_orphans(stack)
