"""`kvpipe bench soak`, small: 60 mixed requests (chat, completions, /generate; streaming or not;
prompts up to 1K) at concurrency 5 through the real PD stack with 5% injected transfer-batch
failures and 10% client disconnects. Every request must end in a success, a clear error or our
own disconnect (no hang, nothing unclear), and both servers' pages, rooms, fds and threads must
be back at the warmed-up baseline. Nothing is timed beyond the soak's own deadlines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpipe.qa import soak
from kvpipe.qa.soak_plan import SoakConfig, plan_requests

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.timeout(240)

N, C, PROMPT_MAX, SEED = 60, 5, 1024, 0


def test_soak_small(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(
        [
            "--model-path",
            str(tiny_model_dir),
            "--num-requests",
            str(N),
            "--concurrency",
            str(C),
            "--prompt-max",
            str(PROMPT_MAX),
            "--failure-prob",
            "0.05",
            "--disconnect-prob",
            "0.1",
            "--seed",
            str(SEED),
            "--warmup-requests",
            "10",
            "--deadline",
            "60",
            "--idle-timeout",
            "60",
            "--sample-interval",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    res = json.loads(out.read_text())
    failed = [c for c in res["checks"] if not c["ok"]]
    assert rc == 0 and res["ok"] and not failed, (failed, res["messages"])
    table = capsys.readouterr().out
    assert "checks:" in table and "FAILED" not in table
    counts = res["counts"]["by_outcome"]
    assert sum(counts.values()) == N and counts["hang"] == 0 and counts["unclear"] == 0
    assert sum(sum(row.values()) for row in res["counts"]["by_kind"].values()) == N
    assert len(res["counts"]["by_kind"]) == 6  # three APIs, each streaming and not
    planned_cuts = sum(
        r.disconnect_after is not None
        for r in plan_requests(SoakConfig(num_requests=N, seed=SEED, prompt_max=PROMPT_MAX))
    )
    # a planned disconnect may meet an injected failure first (a clear error then)
    assert 1 <= counts["disconnected"] <= planned_cuts
    assert counts["success"] >= N // 2  # most requests succeed despite the faults (the router retries)
    rooms = res["transfer_rooms"]
    assert all(rooms[name]["rooms_succeeded"] >= counts["success"] for name in ("prefill", "decode"))
    assert "KV transfer rooms during the run" in table
    for name in ("prefill", "decode"):
        final = res["pools"]["final"][name]
        assert final["free_pages"] == final["total_pages"] and final["disaggregation"]["active_rooms"] == 0
        assert final["disaggregation"]["transfer_rooms"] == 0
        series = res["resources"][name]
        assert series["baseline"] and series["final"] and series["deltas"]["procs"] == 0
