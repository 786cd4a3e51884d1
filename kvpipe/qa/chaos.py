"""`kvpipe bench chaos`: a kill -9 campaign against a supervised local PD stack.

    kvpipe bench chaos --rounds 20 --seed 0 --out docs/bench/chaos.json

The stack is what `kvpipe launch` starts (prefill + decode + sglang-router, cores split), with
short disaggregation timeouts so a dead peer is noticed in seconds, supervised in a thread of
this process (PDStack.supervise, the same loop `kvpipe launch` runs). A few clients keep streaming
requests through the router (chaos_load.py). Each round SIGKILLs the process group of one part
(prefill, decode or router) at a seeded random point of a probe request:

  bootstrap  right after the probe is sent (the decode and prefill are pairing up)
  transfer   a long prompt is being prefilled and its KV pages are on their way
  decode     a long generation is streaming back

or, with --tp-side, one TP worker (a child of that server) alone. A TP group cannot re-form
inside a process, so a server whose TP rank died exits at its next forward (EngineLost, fatal in
async_engine.py) and supervision restarts the whole server: that is the expected recovery, and
what these rounds check. (An idle server notices at its next request, which fails.)

Per round: the survivors were not restarted (same pids), every request in flight at the kill
ended with a final status within the deadline, new requests succeed once the part is back, and
once idle both servers have every KV page free and no active rooms. The result is one JSON
object (rounds, kills per target and phase, in-flight outcomes, restart times, leaks) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from kvpipe.harness import driver
from kvpipe.harness.probe import engine_stats
from kvpipe.launch.stack import PARTS, PDStack
from kvpipe.launch.start import start_pd_stack
from kvpipe.launch.supervisor import PartState
from kvpipe.model.presets import model_path_or_preset
from kvpipe.qa.chaos_load import FINAL, Load, Sent, generate
from kvpipe.qa.chaos_plan import LONG_PROMPT, TP_CHILD, ChaosConfig, Phase, plan_rounds
from kvpipe.qa.chaos_report import fmt_s, summarize, table
from kvpipe.qa.chaos_round import RoundResult
from kvpipe.qa.checks import failed
from kvpipe.qa.leaks import wait_idle


def child_pids(pid: int, marker: bytes = b"kvpipe.engine.tp_group") -> list[int]:
    """PIDs of the processes `pid` started whose command line contains `marker` (TP workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and marker in cmd:
            out.append(int(entry))
    return sorted(out)


def server_state(url: str) -> Mapping[str, Any]:
    """engine_stats, raising when the server does not answer (wait_until counts that as not yet)."""
    st = engine_stats(url)
    if st is None:
        raise httpx.HTTPError(f"{url}/server_info did not answer")
    return st


def wait_until(fn: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    """fn() until it returns something truthy (returned) or the timeout (None); fn's HTTP errors
    count as not yet."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            got = fn()
        except (httpx.HTTPError, KeyError, ValueError):
            got = None
        if got:
            return got
        time.sleep(interval_s)
    return None


class Campaign:
    """One supervised stack, rounds run against it one after the other."""

    def __init__(self, cfg: ChaosConfig, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)):
        self.cfg, self.log = cfg, log
        self.rng = random.Random(cfg.seed + 1)
        self.stack: PDStack | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.gave_up = False

    # ---- the stack --------------------------------------------------------------------------------
    def start(self) -> PDStack:
        cfg = self.cfg
        tp_args = ["--tp-size", "2"]
        self.stack = stack = start_pd_stack(
            cfg.model_path,
            server_args=list(cfg.server_args),
            prefill_args=tp_args if cfg.tp_side == "prefill" else [],
            decode_args=tp_args if cfg.tp_side == "decode" else [],
            log_dir=cfg.log_dir,
            timeout_s=180.0,
            api_keys=True,  # as `kvpipe launch`: its clients find the keys by URL (server/client_keys.py)
        )

        def supervise() -> None:
            self.gave_up = not stack.supervise(cfg.policy, self._stop, lambda line: self.log(f"  supervisor: {line}"))

        self._thread = threading.Thread(target=supervise, daemon=True, name="chaos-supervisor")
        self._thread.start()
        wait_until(lambda: stack.supervisor is not None, 10.0)
        return stack

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        if self.stack is not None:
            self.stack.close()

    def __enter__(self) -> Campaign:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_ok(self) -> bool:
        """One short request through the router: did it succeed?"""
        assert self.stack is not None
        res = driver.run(self.stack.router_url, [generate([5 + i % 200 for i in range(40)], 8)], 1, 30.0, False)
        return res.outcomes[0].ok

    # ---- one round --------------------------------------------------------------------------------
    def run_round(self, number: int, target: str, phase: Phase) -> RoundResult:
        cfg, stack = self.cfg, self.stack
        assert stack is not None and stack.supervisor is not None
        res = RoundResult(number, target, phase)
        victim = target if target != TP_CHILD else cfg.tp_side  # the part supervision must restart
        assert victim is not None, "TP-child rounds need a tp_side"
        pids = {n: stack.proc(n).pid for n in PARTS}
        restarts = dict(stack.restarts)
        with Load(stack.router_url, cfg.clients, self.rng.randrange(1 << 30), cfg.inflight_deadline_s) as load:
            wait_until(lambda: any(s.outcome is not None and s.outcome.ok for s in load.snapshot()), 30.0)
            reached = self._probe(load, phase)
            res.phase_reached = wait_until(reached, 30.0, 0.01) is not None
            t_kill = time.monotonic()
            res.killed_pid = self._kill(target, victim)
            res.restarted = victim
            self.log(
                f"round {number}: killed {target} (pid {res.killed_pid}) at {phase.value}"
                f"{'' if res.phase_reached else ' (phase not reached: killed anyway)'}"
            )
            self._recover(res, victim, restarts[victim], t_kill)
            load.stop()
            self._tally_inflight(res, load.snapshot(), t_kill)
        for n in PARTS:
            if n != victim and (stack.proc(n).pid != pids[n] or stack.restarts[n] != restarts[n]):
                res.survivors_restarted.append(n)
        idle = wait_idle({"prefill": stack.prefill_url, "decode": stack.decode_url}, cfg.idle_timeout_s)
        res.leaks = failed(idle.checks)
        if self.gave_up:
            res.error = res.error or "the supervisor gave up (restart bound reached)"
        self.log(
            f"round {number}: {'ok' if res.ok else 'FAILED'} - {victim} back in {fmt_s(res.restart_s)} s, "
            f"serving again {fmt_s(res.first_success_s)} s after the kill; in flight {dict(res.inflight)}"
            + (f"; leaks {res.leaks}" if res.leaks else "")
            + (f"; {res.error}" if res.error else "")
        )
        return res

    def _recover(self, res: RoundResult, victim: str, restarts_before: int, t_kill: float) -> None:
        """Wait for `victim` to be restarted and healthy, then for requests to succeed again."""
        timeout = self.cfg.recover_timeout_s
        up = wait_until(lambda: self.back_up(victim, restarts_before), timeout, 0.1)
        if up is None:
            res.error = f"{victim} not back up within {timeout:g} s"
            return
        res.restart_s = up - t_kill
        if wait_until(self.check_ok, max(1.0, timeout - (time.monotonic() - t_kill)), 0.5):
            res.first_success_s = time.monotonic() - t_kill
            res.serves_again = all(self.check_ok() for _ in range(3))

    def _tally_inflight(self, res: RoundResult, sent: list[Sent], t_kill: float) -> None:
        """How the requests in flight at the kill ended: each within the deadline with a final
        status, else it hung."""
        for s in sent:
            if not s.in_flight_at(t_kill):
                continue
            late = s.end is None or s.end - t_kill > self.cfg.inflight_deadline_s
            if s.outcome is not None and s.outcome.end in FINAL and not late:
                res.inflight[s.outcome.end.value] += 1
            else:
                res.inflight["hung"] += 1
                res.hung.append(s.describe())

    def _probe(self, load: Load, phase: Phase) -> Callable[[], bool]:
        """Send the phase's probe request besides the load; returns a condition that holds once the
        probe is where the kill should land."""
        stack = self.stack
        assert stack is not None
        ids = [3 + (i * 7919) % 250 for i in range(LONG_PROMPT)]
        if phase is Phase.BOOTSTRAP:
            delay = self.rng.uniform(0.0, 0.05)
            probe = load.send("probe", generate(ids[:200], 16))
            return lambda: time.monotonic() >= probe.start + delay
        if phase is Phase.TRANSFER:
            written = server_state(stack.prefill_url)["disaggregation"]["bytes_written"]
            load.send("probe", generate(ids, 8))

            def transferring() -> bool:
                st = server_state(stack.prefill_url)
                return bool(st["disaggregation"]["bytes_written"] > written and st["num_running"] >= 1)

            return transferring
        events = self.rng.randint(2, 20)
        probe = load.send("probe", generate(ids[:60], 1500))
        return lambda: probe.events >= events

    def _kill(self, target: str, victim: str) -> int:
        stack = self.stack
        assert stack is not None
        if target == TP_CHILD:
            children = child_pids(stack.proc(victim).pid)
            if not children:
                raise RuntimeError(f"{victim} has no TP worker to kill")
            pid = self.rng.choice(children)
            os.kill(pid, signal.SIGKILL)  # the child alone: its server has to notice
            return pid
        pid = stack.proc(target).pid
        try:
            os.killpg(pid, signal.SIGKILL)  # the server and its TP workers, as an OOM kill would
        except ProcessLookupError:
            pass
        return pid

    def back_up(self, name: str, restarts_before: int) -> float | None:
        """The monotonic time `name` was restarted and became healthy again, else None."""
        stack = self.stack
        assert stack is not None and stack.supervisor is not None
        part = stack.supervisor[name]
        if part.restarts <= restarts_before or part.state is not PartState.UP:
            return None
        ev = part.events[-1]
        return None if ev.up_after_s is None else ev.exited_at + ev.up_after_s

    # ---- the campaign -----------------------------------------------------------------------------
    def wait_serving(self, timeout_s: float = 60.0) -> None:
        if wait_until(self.check_ok, timeout_s, 0.5) is None:
            raise RuntimeError(f"the stack does not serve a request within {timeout_s:g} s")

    def run(self, plan: list[tuple[str, Phase]]) -> list[RoundResult]:
        self.wait_serving()
        results = []
        for i, (target, phase) in enumerate(plan, start=1):
            try:
                results.append(self.run_round(i, target, phase))
            except (RuntimeError, OSError, httpx.HTTPError) as e:  # recorded; the next round may still run
                self.log(f"round {i}: FAILED - {type(e).__name__}: {e}")
                results.append(RoundResult(i, target, phase, error=f"{type(e).__name__}: {e}"))
            if self.gave_up:
                break
        return results


def add_args(p: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    p.add_argument("--rounds", type=int, default=d.rounds, help="kills, one per round")
    p.add_argument("--seed", type=int, default=d.seed, help="the order of the kills and where they land")
    p.add_argument("--clients", type=int, default=d.clients, help="clients streaming through the router")
    p.add_argument(
        "--tp-side",
        choices=["prefill", "decode"],
        default=None,
        help="serve this side with --tp-size 2 and add rounds that kill one of its TP workers",
    )
    p.add_argument("--tp-rounds", type=int, default=d.tp_rounds, help="rounds killing a TP worker (with --tp-side)")
    p.add_argument(
        "--inflight-deadline",
        type=float,
        default=d.inflight_deadline_s,
        help="seconds within which a request in flight at a kill must end",
    )
    p.add_argument("--model-path", default=None, help="checkpoint directory or .gguf file (default: the tiny preset)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a new temporary directory, printed)")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    p.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpipe-chaos-")  # not the terminal: the table goes there
    print(f"server logs: {log_dir}", file=sys.stderr, flush=True)
    cfg = ChaosConfig(
        rounds=args.rounds,
        seed=args.seed,
        clients=args.clients,
        tp_side=args.tp_side,
        tp_rounds=args.tp_rounds,
        inflight_deadline_s=args.inflight_deadline,
        model_path=model_path_or_preset(args.model_path),
        log_dir=log_dir,
    )
    plan = plan_rounds(cfg)
    campaign = Campaign(cfg)
    try:
        campaign.start()
        results = campaign.run(plan)
    finally:
        campaign.close()
    summary = summarize(cfg, results, campaign.stack)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1) if args.json else table(summary), flush=True)
    return 0 if summary["rounds_ok"] == len(plan) else 1
