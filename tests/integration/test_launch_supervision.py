"""Supervision of the local PD stack (`kvpipe launch`) under kill -9: the decode, the prefill and
the router are each SIGKILLed once with requests in flight (the `bench chaos` rounds). The dead
part comes back on the same ports, the survivors are never restarted, every request in flight
ends with a final status, new requests succeed, and both servers end idle with no page held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.launch.stack import PARTS
from kvpipe.launch.supervisor import PartState, RestartPolicy
from kvpipe.qa.chaos import Campaign
from kvpipe.qa.chaos_load import FINAL
from kvpipe.qa.chaos_plan import ChaosConfig, Phase

pytest.importorskip("mooncake.engine")
pytest.importorskip("sglang_router")
pytestmark = pytest.mark.timeout(240)

ROUNDS = [("decode", Phase.DECODE), ("prefill", Phase.TRANSFER), ("router", Phase.BOOTSTRAP)]


@pytest.fixture(scope="module")
def campaign(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campaign]:
    cfg = ChaosConfig(
        rounds=len(ROUNDS),
        clients=2,
        model_path=str(tiny_model_dir),
        log_dir=str(tmp_path_factory.mktemp("launch-supervision")),
        policy=RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=0.5, backoff_max_s=2.0),
    )
    with Campaign(cfg, log=print) as c:
        yield c


def test_each_part_killed_once_comes_back_alone(campaign: Campaign) -> None:
    stack = campaign.stack
    assert stack is not None
    campaign.wait_serving()
    for i, (target, phase) in enumerate(ROUNDS, start=1):
        before = {n: stack.proc(n).pid for n in PARTS}
        r = campaign.run_round(i, target, phase)
        logs = "\n".join(
            f"--- {s.name}\n{open(s.log_path, errors='replace').read()[-2000:]}" for s in stack.specs if s.log_path
        )
        assert r.ok, (r.as_dict(), logs)
        assert r.killed_pid == before[target] and stack.proc(target).pid != before[target]
        assert all(stack.proc(n).pid == before[n] for n in PARTS if n != target)  # survivors untouched
        assert sum(r.inflight.values()) >= 1  # at least the probe was in flight at the kill
        assert set(r.inflight) <= {s.value for s in FINAL}, r.inflight  # each ended, none hung
        assert r.restart_s is not None and r.first_success_s is not None and r.first_success_s >= r.restart_s
        assert r.leaks == []
    assert stack.restarts == {"prefill": 1, "decode": 1, "router": 1}
    assert all(stack.supervisor[n].state is PartState.UP for n in PARTS)
    events = stack.supervisor.events()
    assert [e.part for e in events] == [t for t, _ in ROUNDS] and all(e.exit_code == -9 for e in events)
