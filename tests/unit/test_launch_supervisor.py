"""Restart policy of `kvpipe launch` (supervisor.py) and the launcher's supervision tick, on a
fake clock and fake processes: backoff doubling to a cap, the bound per window, survivors left alone."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path

import pytest

from kvpipe.commands import launch as launch_cmd
from kvpipe.launch import stack as stack_mod
from kvpipe.launch.stack import PartSpec, PDStack
from kvpipe.launch.supervisor import PartState, PartTracker, RestartPolicy, Supervisor


def test_backoff_doubles_up_to_the_cap() -> None:
    p = RestartPolicy(backoff_s=1.0, backoff_max_s=10.0)
    assert [p.delay_s(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert p.delay_s(10_000) == 10.0  # no overflow


@pytest.mark.parametrize(
    "kw",
    [
        {"max_restarts": -1},
        {"window_s": 0},
        {"backoff_s": -1.0},
        {"backoff_s": 5.0, "backoff_max_s": 1.0},
        {"start_timeout_s": 0},
    ],
)
def test_bad_policies_are_rejected(kw: dict) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kw)


def crash_and_recover(t: PartTracker, now: float, pid: int = 100) -> float:
    """One exit, the restart at its due time and the health check right after; returns the delay."""
    t.exited(now, -9)
    assert t.state is PartState.BACKOFF and not t.restart_due(t.due_at - 0.01)
    delay = t.due_at - now
    assert t.restart_due(t.due_at)
    t.spawned(t.due_at, pid)
    assert t.state is PartState.STARTING
    t.healthy(t.due_at + 0.5)
    assert t.state is PartState.UP
    return delay


def test_restarts_back_off_and_give_up_past_the_bound() -> None:
    t = PartTracker("decode", RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, backoff_max_s=30.0))
    delays = [crash_and_recover(t, now) for now in (0.0, 10.0, 20.0)]
    assert delays == [1.0, 2.0, 4.0] and t.restarts == 3
    line = t.exited(30.0, 1)
    assert t.state is PartState.FAILED and "giving up" in line and "4 exits within 100 s" in line
    assert t.restarts == 3  # no fourth restart was scheduled
    assert [e.up_after_s for e in t.events] == [1.5, 2.5, 4.5]


def test_a_quiet_window_resets_the_backoff_and_the_bound() -> None:
    t = PartTracker("prefill", RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=1.0, backoff_max_s=30.0))
    assert crash_and_recover(t, 0.0) == 1.0
    assert crash_and_recover(t, 10.0) == 2.0
    # the first two restarts are older than the window now: back to 1 s, and not FAILED
    assert crash_and_recover(t, 200.0) == 1.0
    assert t.state is PartState.UP and t.restarts == 3


def test_zero_restarts_stops_at_the_first_exit() -> None:
    t = PartTracker("router", RestartPolicy(max_restarts=0))
    assert "restarts are off" in t.exited(5.0, 0) and t.state is PartState.FAILED


def test_an_exit_while_starting_counts_as_another_restart() -> None:
    t = PartTracker("decode", RestartPolicy(max_restarts=5, backoff_s=1.0))
    t.exited(0.0, -9)
    t.spawned(1.0, 7)
    t.exited(2.0, 1)  # died before it was healthy
    assert t.state is PartState.BACKOFF and t.restarts == 2 and t.due_at == 4.0
    with pytest.raises(RuntimeError):
        t.healthy(3.0)  # not started again yet


class FakeProc:
    _next_pid = 1000

    def __init__(self, cmd: list[str]) -> None:
        FakeProc._next_pid += 1
        self.pid, self.args, self.returncode = FakeProc._next_pid, cmd, None

    def poll(self) -> int | None:
        return self.returncode


def test_tick_restarts_only_the_dead_part(monkeypatch: pytest.MonkeyPatch) -> None:
    healthy: set[str] = set()
    envs: list[dict | None] = []
    monkeypatch.setattr(stack_mod, "spawn", lambda cmd, log, pin=None, env=None: envs.append(env) or FakeProc(cmd))
    monkeypatch.setattr(stack_mod, "answers", lambda url: url in healthy)
    specs = [PartSpec(n, (n,), f"http://{n}/health", env=(("TOKEN", "t"),)) for n in stack_mod.PARTS]
    stack = PDStack("p", "d", "r", 1, specs=specs, procs=[FakeProc([n]) for n in stack_mod.PARTS])
    sup = stack.supervisor = Supervisor(list(stack_mod.PARTS), RestartPolicy(max_restarts=1, backoff_s=2.0))
    lines: list[str] = []
    pids = [p.pid for p in stack.procs]
    stack.procs[1].returncode = -9  # decode killed
    assert stack._tick(sup, 10.0, lines.append)
    assert sup["decode"].state is PartState.BACKOFF and "killed by signal 9" in lines[-1]
    assert stack._tick(sup, 11.0, lines.append) and stack.procs[1].pid == pids[1]  # still backing off
    assert stack._tick(sup, 12.0, lines.append)
    assert stack.procs[1].pid != pids[1] and stack.procs[1].args == ["decode"]  # same command,
    assert envs == [{"TOKEN": "t"}]  # same environment (the stack's auth token)
    assert sup["decode"].state is PartState.STARTING
    assert stack._tick(sup, 13.0, lines.append) and sup["decode"].state is PartState.STARTING  # not healthy yet
    healthy.add("http://decode/health")
    assert stack._tick(sup, 14.0, lines.append) and sup["decode"].state is PartState.UP
    assert "back up" in lines[-1]
    assert [stack.procs[0].pid, stack.procs[2].pid] == [pids[0], pids[2]]  # survivors untouched
    assert stack.restarts == {"prefill": 0, "decode": 1, "router": 0}
    stack.procs[1].returncode = 1  # past the bound (1 restart): the stack gives up
    assert not stack._tick(sup, 20.0, lines.append)
    assert sup.failed == ["decode"] and "giving up" in lines[-1]


def test_launch_gives_up_with_exit_code_1_and_stops_in_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tiny_model_dir: Path
) -> None:
    stopped: list[str] = []
    procs = [FakeProc([n]) for n in stack_mod.PARTS]
    procs[0].returncode = 1  # the prefill dies at once; --max-restarts 0: no restart
    stack = PDStack(
        "p", "d", "r", 1, specs=[PartSpec(n, (n,), f"http://{n}/health") for n in stack_mod.PARTS], procs=procs
    )
    monkeypatch.setattr(launch_cmd, "start_pd_stack", lambda *a, **kw: stack)
    monkeypatch.setattr(stack_mod, "stop_process", lambda p, timeout_s=10.0: stopped.append(p.args[0]))
    monkeypatch.setattr(stack_mod, "spawn", lambda *a, **kw: pytest.fail("nothing may be restarted"))
    parser = argparse.ArgumentParser()
    launch_cmd.add_args(parser)
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        args = parser.parse_args(["--max-restarts", "0", "--model-path", str(tiny_model_dir)])
        assert launch_cmd.run(args, []) == 1
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert stopped == ["router", "decode", "prefill"]
    out = capsys.readouterr()
    assert "prefill exited (exit code 1); restarts are off: stopping the stack" in out.out
    assert "stopped (restarts: prefill 0, decode 0, router 0)" in out.err


def test_launch_writes_its_prometheus_targets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """--prometheus-targets: once the stack is up, its parts' /metrics addresses are in the file
    (the stack then stops at once: its prefill exits and restarts are off)."""
    procs = [FakeProc([n]) for n in stack_mod.PARTS]
    procs[0].returncode = 1
    stack = PDStack(
        "http://127.0.0.1:4001",
        "http://127.0.0.1:4002",
        "http://127.0.0.1:8000",
        4003,
        specs=[PartSpec(n, (n,), f"http://{n}/health") for n in stack_mod.PARTS],
        procs=procs,
        router_metrics_url="http://127.0.0.1:4004",
    )
    monkeypatch.setattr(launch_cmd, "start_pd_stack", lambda *a, **kw: stack)
    monkeypatch.setattr(stack_mod, "stop_process", lambda p, timeout_s=10.0: None)
    parser = argparse.ArgumentParser()
    launch_cmd.add_args(parser)
    path = tmp_path / "targets" / "kvpipe.json"
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        args = parser.parse_args(
            ["--max-restarts", "0", "--model-path", str(tiny_model_dir), "--prometheus-targets", str(path)]
        )
        assert launch_cmd.run(args, []) == 1
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    groups = json.loads(path.read_text())
    assert {g["labels"]["part"]: g["targets"] for g in groups} == {
        "prefill": ["127.0.0.1:4001"],
        "decode": ["127.0.0.1:4002"],
        "router": ["127.0.0.1:4004"],
    }
