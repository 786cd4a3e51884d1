"""The router going away (issue 50): sglang-router SIGKILLed mid-stream under a small load on a
`kvpipe launch`-style stack (supervised, api keys, cores split). Every stream in flight ends with
an error within its deadline (none hangs, none claims success), both servers give back what those
requests held (pages free, no request running or reserved, no room in the transfer layer, the
same as before the load), and once the supervisor has restarted the router new requests are served."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.harness.probe import engine_stats
from kvpipe.launch.supervisor import RestartPolicy
from kvpipe.qa.chaos import Campaign, wait_until
from kvpipe.qa.chaos_load import FINAL, Load, generate
from kvpipe.qa.chaos_plan import ChaosConfig
from kvpipe.qa.checks import failed
from kvpipe.qa.leaks import wait_idle

pytest.importorskip("mooncake.engine")
pytest.importorskip("sglang_router")
pytestmark = pytest.mark.timeout(300)

STREAMS = 6
OUTPUT_TOKENS = 1000  # seconds of decoding for six streams at once (6 x 1,120 tokens): mid-stream at the kill
DEADLINE_S = 40.0  # each stream in flight at the kill ends by then


@pytest.fixture(scope="module")
def campaign(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campaign]:
    cfg = ChaosConfig(
        rounds=1,
        clients=0,  # only this test's streams
        model_path=str(tiny_model_dir),
        log_dir=str(tmp_path_factory.mktemp("router-restart")),
        policy=RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=0.5, backoff_max_s=2.0),
    )
    with Campaign(cfg, log=print) as c:
        yield c


def test_router_killed_mid_stream_frees_everything_and_comes_back(campaign: Campaign) -> None:
    stack = campaign.stack
    assert stack is not None and stack.supervisor is not None
    campaign.wait_serving()
    urls = {"prefill": stack.prefill_url, "decode": stack.decode_url}
    start = wait_idle(urls, 30.0)
    assert start.ok, failed(start.checks)
    baselines = {n: engine_stats(u) or {} for n, u in urls.items()}
    router = stack.proc("router").pid
    with Load(stack.router_url, 0, 0, DEADLINE_S, extra=STREAMS) as load:
        sent = [
            load.send("stream", generate([3 + (i * 31 + j * 7) % 250 for j in range(120)], OUTPUT_TOKENS))
            for i in range(STREAMS)
        ]
        streaming = wait_until(lambda: all(s.events >= 2 for s in sent), 120.0, 0.05)
        assert streaming, [s.describe() for s in sent]
        assert engine_stats(stack.decode_url)["num_running"] >= 1  # type: ignore[index]
        t_kill = time.monotonic()
        os.killpg(router, signal.SIGKILL)
        assert load.stop(DEADLINE_S + 5.0), [s.describe() for s in sent]
    inflight = [s for s in sent if s.in_flight_at(t_kill)]
    assert len(inflight) == STREAMS, [s.describe() for s in sent]
    for s in inflight:
        assert s.outcome is not None and s.end is not None, s.describe()
        assert s.outcome.end in FINAL and not s.outcome.ok, s.describe()  # an error, not a success
        assert s.end - t_kill <= DEADLINE_S, s.describe()
    # the router dropping its upstream connections aborts the streams on the decode: all given back
    idle = wait_idle(urls, 30.0, baselines)
    assert idle.ok, failed(idle.checks)
    for name in urls:
        assert idle.stats[name]["free_pages"] == baselines[name]["free_pages"]
    # the supervisor restarts the router on its port; new requests are served through it
    assert wait_until(lambda: campaign.back_up("router", 0), 60.0, 0.1), stack.supervisor.summary()
    assert stack.proc("router").pid != router
    assert wait_until(campaign.check_ok, 60.0, 0.5), "no request served after the router came back"
    ends = sorted(f"{s.outcome.end.value} after {s.end - t_kill:.1f}s" for s in inflight if s.outcome and s.end)
    print(f"in flight at the kill: {ends}; served again {time.monotonic() - t_kill:.1f}s after the kill")
    assert all(campaign.check_ok() for _ in range(3))
    assert stack.restarts == {"prefill": 0, "decode": 0, "router": 1}
