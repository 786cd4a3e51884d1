"""`kvpipe bench soak --link-fault`, small: the soak's stack across the link testbed (prefill on
side a, decode and router on side b, 100 Mbit/s) and a 3 s partition from the start of a load of 16 mixed
requests at concurrency 4, shorter than the 10 s PD heartbeat timeout: nothing may be lost (every
request served or failed clearly, none hung), every success is exact when sent again after the
heal, nothing leaks, and the stack serves again after the heal. Nothing is timed beyond the
soak's own deadlines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpipe.harness.link_faults import nft_missing
from kvpipe.harness.testbed import can_run
from kvpipe.qa import soak

pytest.importorskip("mooncake.engine")
pytestmark = [
    pytest.mark.timeout(480),
    pytest.mark.skipif(not can_run(), reason="needs root and iproute2"),
    pytest.mark.skipif(nft_missing() is not None, reason=str(nft_missing())),
]


def test_soak_across_a_partition(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "soak.json"
    argv = ["--model-path", str(tiny_model_dir), "--num-requests", "16", "--concurrency", "4"]
    argv += ["--prompt-max", "1024", "--failure-prob", "0", "--disconnect-prob", "0", "--warmup-requests", "4"]
    argv += ["--deadline", "90", "--idle-timeout", "90", "--sample-interval", "1", "--no-progress"]
    argv += ["--server-args=--disable-radix-cache", "--log-dir", str(tmp_path / "logs"), "--out", str(out)]
    argv += ["--link-fault", "partition:3s", "--link-fault-after", "0", "--link-rate", "100mbit"]
    rc = soak.main(argv)
    res = json.loads(out.read_text())
    failed = [c for c in res["checks"] if not c["ok"]]
    assert rc == 0 and res["ok"] and not failed, (failed, res["messages"], res["link_fault"])
    lf = res["link_fault"]
    assert lf["fault"] == "partition 3 s" and lf["replay"]["checked"] >= 1
    assert lf["replay"]["exact"] == lf["replay"]["checked"]
    assert res["counts"]["by_outcome"]["hang"] == 0 and res["counts"]["by_outcome"]["unclear"] == 0
    assert "link fault partition 3 s" in capsys.readouterr().out
