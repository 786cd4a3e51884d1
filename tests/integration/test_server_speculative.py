"""`kvpipe serve --speculative-algorithm NGRAM`: a finished request's meta_info carries SGLang's
spec_* fields (absent while streaming, as SGLang), /metrics counts verify steps, proposed and
accepted drafts, every page is free afterwards; the refused algorithms stop the command with a
one-line error."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import ServerProc, server_fixture

# a repeated unit: the tiny model's greedy continuation repeats too, so drafts get accepted
PROMPT = [17, 91, 203, 45, 8] * 8 + [17, 91]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    yield from server_fixture(
        tiny_model_dir,
        tmp_path_factory.mktemp("spec"),
        "--page-size",
        "16",
        "--max-total-tokens",
        "8192",
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "5",
    )


def test_meta_info_and_metrics(server: ServerProc) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 24
    assert meta["spec_verify_ct"] + meta["spec_accept_token_num"] == 23  # the first token is the prefill's
    assert meta["spec_accept_token_num"] > 0 and meta["spec_accept_length"] > 1.0
    assert meta["spec_draft_token_num"] >= meta["spec_accept_token_num"]
    assert server.metric("kvpipe_spec_accepted_tokens_total") == meta["spec_accept_token_num"]
    assert server.metric("kvpipe_spec_verify_steps_total") == meta["spec_verify_ct"]
    server.wait_idle()


def test_nextn_without_an_mtp_layer_is_refused(tiny_model_dir: Path) -> None:
    """NEXTN on a checkpoint without multi-token-prediction layers (the tiny Llama) ends the
    command with the reason (EAGLE3, not built, is refused by SpeculativeConfig: test_spec_verify)."""
    run = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "generate", "--model-path", str(tiny_model_dir), "--prompt", "hi"]
        + ["--speculative-algorithm", "NEXTN"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "multi-token-prediction" in run.stderr, run.stderr[-2000:]
