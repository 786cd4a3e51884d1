"""`kvpipe bench chaos`: a kill -9 campaign against a supervised local PD stack.

    kvpipe bench chaos --rounds 20 --seed 0 --out docs/bench/chaos.json

The stack is what `kvpipe launch` starts (prefill + decode + sglang-router, cores split), with
short disaggregation timeouts so a dead peer is noticed in seconds, supervised in a thread of
this process (PDStack.supervise, the same loop `kvpipe launch` runs). A few client threads keep
streaming requests through the router. Each round SIGKILLs the process group of one part
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
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

from kvpipe.bench.probe import engine_stats
from kvpipe.qa.chaos_load import FINAL, Load, Outcome, Status, body, stream_request
from kvpipe.server.launcher import PARTS, PDStack, start_pd_stack
from kvpipe.server.supervisor import PartState, RestartPolicy

TP_CHILD = "tp-child"
# The lifecycle tests' timeouts: a peer silent for 5 heartbeats (2.5 s) is dead, a bootstrap or
# transfer that does not progress fails in seconds, so in-flight requests end quickly.
FAST_FLAGS = (
    "--page-size",
    "16",
    "--max-total-tokens",
    "32768",
    "--chunked-prefill-size",
    "128",
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "5",
    "--disaggregation-waiting-timeout",
    "20",
    "--disaggregation-transfer-timeout",
    "3",
)
LONG_PROMPT = 4000  # tokens: ~30 chunks of 128, seconds of prefill to kill into


class Phase(Enum):
    BOOTSTRAP = "bootstrap"
    TRANSFER = "transfer"
    DECODE = "decode"


@dataclass(frozen=True)
class ChaosConfig:
    rounds: int = 20
    seed: int = 0
    clients: int = 3
    tp_side: str | None = None  # "prefill" or "decode": served with --tp-size 2, TP-child rounds added
    tp_rounds: int = 2  # of `rounds`, when tp_side is set
    inflight_deadline_s: float = 40.0  # a request in flight at the kill ends by then
    recover_timeout_s: float = 120.0  # kill -> part healthy and a request through the router succeeds
    idle_timeout_s: float = 30.0
    model_path: str | None = None
    log_dir: str | None = None
    server_args: tuple[str, ...] = FAST_FLAGS
    policy: RestartPolicy = RestartPolicy(max_restarts=5, window_s=60.0, backoff_s=1.0, backoff_max_s=8.0)

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.clients < 0 or self.tp_side not in (None, "prefill", "decode"):
            raise ValueError(f"invalid chaos config: {self}")


def plan_rounds(cfg: ChaosConfig) -> list[tuple[str, Phase]]:
    """(target, phase) per round: every part x phase pairing equally often (seeded order), then
    the TP-child rounds at seeded places."""
    rng = random.Random(cfg.seed)
    n_tp = min(cfg.tp_rounds, cfg.rounds) if cfg.tp_side else 0
    combos = [(t, p) for t in PARTS for p in Phase]
    plan: list[tuple[str, Phase]] = []
    while len(plan) < cfg.rounds - n_tp:
        batch = combos[:]
        rng.shuffle(batch)
        plan += batch
    plan = plan[: cfg.rounds - n_tp]
    for _ in range(n_tp):
        plan.insert(rng.randrange(len(plan) + 1), (TP_CHILD, rng.choice(list(Phase))))
    return plan


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


def idle_leaks(stack: PDStack, timeout_s: float) -> list[str]:
    """Wait for both servers to be idle: no request running or waiting, every page free, no active
    room. Returns what is still held after `timeout_s` (empty: no leak)."""

    def held(url: str) -> list[str]:
        st = server_state(url)
        rooms = (st.get("disaggregation") or {}).get("active_rooms", 0)
        bad = {
            "running": st["num_running"],
            "waiting": st["num_waiting"],
            "pages held": st["total_pages"] - st["free_pages"],
            "active rooms": rooms,
        }
        return [f"{k} {v}" for k, v in bad.items() if v]

    found: dict[str, list[str]] = {}
    for name, url in (("prefill", stack.prefill_url), ("decode", stack.decode_url)):
        if wait_until(lambda: not held(url) and "idle", timeout_s) is None:
            try:
                found[name] = held(url)
            except httpx.HTTPError as e:
                found[name] = [f"no /server_info: {type(e).__name__}"]
    return [f"{n}: {', '.join(v)}" for n, v in found.items()]


@dataclass
class RoundResult:
    round: int
    target: str
    phase: Phase
    killed_pid: int = 0
    phase_reached: bool = False  # the probe got to its phase before the kill (else killed anyway)
    restarted: str = ""  # the part that supervision restarted
    restart_s: float | None = None  # kill -> that part healthy again
    first_success_s: float | None = None  # kill -> a new request through the router succeeded
    serves_again: bool = False  # and the next few succeeded too
    survivors_restarted: list[str] = field(default_factory=list)
    inflight: Counter = field(default_factory=Counter)  # status -> count, requests in flight at the kill
    hung: list[str] = field(default_factory=list)  # requests with no final status by the deadline
    leaks: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.serves_again
            and not self.survivors_restarted
            and not self.hung
            and not self.leaks
            and self.restart_s is not None
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "target": self.target,
            "phase": self.phase.value,
            "ok": self.ok,
            "killed_pid": self.killed_pid,
            "phase_reached": self.phase_reached,
            "restarted": self.restarted,
            "restart_s": _r(self.restart_s),
            "first_success_s": _r(self.first_success_s),
            "serves_again": self.serves_again,
            "survivors_restarted": self.survivors_restarted,
            "inflight": dict(self.inflight),
            "hung": self.hung,
            "leaks": self.leaks,
            "error": self.error,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


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
        tp = {"prefill_args": [], "decode_args": []}
        if cfg.tp_side:
            tp[f"{cfg.tp_side}_args"] = ["--tp-size", "2"]
        self.stack = start_pd_stack(
            cfg.model_path, server_args=list(cfg.server_args), log_dir=cfg.log_dir, timeout_s=180.0, **tp
        )

        def supervise() -> None:
            assert self.stack is not None
            self.gave_up = not self.stack.supervise(
                cfg.policy, self._stop, lambda line: self.log(f"  supervisor: {line}")
            )

        self._thread = threading.Thread(target=supervise, daemon=True, name="chaos-supervisor")
        self._thread.start()
        wait_until(lambda: self.stack.supervisor is not None, 10.0)
        return self.stack

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

    def _check_ok(self) -> dict[str, Any] | None:
        """One short request through the router; its outcome (as a dict) when it succeeded, else None."""
        assert self.stack is not None
        out = Outcome("check", time.monotonic())
        stream_request(self.stack.router_url, body([5 + i % 200 for i in range(40)], 8), out, 30.0)
        return out.as_dict() if out.status is Status.OK else None

    # ---- one round --------------------------------------------------------------------------------
    def run_round(self, number: int, target: str, phase: Phase) -> RoundResult:
        cfg, stack = self.cfg, self.stack
        assert stack is not None and stack.supervisor is not None
        res = RoundResult(number, target, phase)
        victim = cfg.tp_side if target == TP_CHILD else target  # the part supervision must restart
        pids = {n: stack.proc(n).pid for n in PARTS}
        restarts = dict(stack.restarts)
        with Load(stack.router_url, cfg.clients, self.rng.randrange(1 << 30), cfg.inflight_deadline_s) as load:
            wait_until(lambda: any(o.status is Status.OK for o in load.snapshot()), 30.0)
            probe, probe_out, reached = self._probe(phase)
            res.phase_reached = wait_until(reached, 30.0, 0.01) is not None
            t_kill = time.monotonic()
            res.killed_pid = self._kill(target, victim)
            res.restarted = victim
            self.log(
                f"round {number}: killed {target} (pid {res.killed_pid}) at {phase.value}"
                f"{'' if res.phase_reached else ' (phase not reached: killed anyway)'}"
            )
            up = wait_until(lambda: self._back_up(victim, restarts[victim]), cfg.recover_timeout_s, 0.1)
            if up is None:
                res.error = f"{victim} not back up within {cfg.recover_timeout_s:g} s"
            else:
                res.restart_s = up - t_kill
                ok = wait_until(self._check_ok, max(1.0, cfg.recover_timeout_s - (time.monotonic() - t_kill)), 0.5)
                if ok:
                    res.first_success_s = time.monotonic() - t_kill
                    res.serves_again = all(self._check_ok() for _ in range(3))
            load.stop()
            probe.join(cfg.inflight_deadline_s + 5.0)
        outcomes = [o for o in [*load.snapshot(), probe_out] if o.in_flight_at(t_kill)]
        for o in outcomes:
            late = o.end is None or o.end - t_kill > cfg.inflight_deadline_s
            if o.status in FINAL and not late:
                res.inflight[o.status.value] += 1
            else:
                res.inflight["hung"] += 1
                res.hung.append(f"{o.kind}: {o.status.value if o.status else 'running'} {o.detail}")
        for n in PARTS:
            if n != victim and (stack.proc(n).pid != pids[n] or stack.restarts[n] != restarts[n]):
                res.survivors_restarted.append(n)
        res.leaks = idle_leaks(stack, cfg.idle_timeout_s)
        if self.gave_up:
            res.error = res.error or "the supervisor gave up (restart bound reached)"
        self.log(
            f"round {number}: {'ok' if res.ok else 'FAILED'} - {victim} back in {_fmt(res.restart_s)} s, "
            f"serving again {_fmt(res.first_success_s)} s after the kill; in flight {dict(res.inflight)}"
            + (f"; leaks {res.leaks}" if res.leaks else "")
            + (f"; {res.error}" if res.error else "")
        )
        return res

    def _probe(self, phase: Phase) -> tuple[threading.Thread, Outcome, Callable[[], bool]]:
        """Start the phase's probe request in a thread; returns it, its outcome, and a condition
        that holds once the probe is where the kill should land."""
        stack = self.stack
        assert stack is not None
        out = Outcome("probe", time.monotonic())
        ids = [3 + (i * 7919) % 250 for i in range(LONG_PROMPT)]
        if phase is Phase.BOOTSTRAP:
            payload, delay = body(ids[:200], 16), self.rng.uniform(0.0, 0.05)
            reached: Callable[[], bool] = lambda: time.monotonic() >= out.start + delay
        elif phase is Phase.TRANSFER:
            sent = server_state(stack.prefill_url)["disaggregation"]["bytes_written"]
            payload = body(ids, 8)

            def reached() -> bool:
                st = server_state(stack.prefill_url)
                return st["disaggregation"]["bytes_written"] > sent and st["num_running"] >= 1
        else:
            payload, events = body(ids[:60], 1500), self.rng.randint(2, 20)
            reached = lambda: out.events >= events
        t = threading.Thread(
            target=stream_request,
            args=(stack.router_url, payload, out, self.cfg.inflight_deadline_s),
            daemon=True,
            name="chaos-probe",
        )
        t.start()
        return t, out, reached

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

    def _back_up(self, name: str, restarts_before: int) -> float | None:
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
        if wait_until(self._check_ok, timeout_s, 0.5) is None:
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


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def summarize(cfg: ChaosConfig, results: list[RoundResult], stack: PDStack | None) -> dict[str, Any]:
    inflight: Counter = Counter()
    for r in results:
        inflight.update(r.inflight)
    times: dict[str, list[float]] = {}
    for r in results:
        if r.restart_s is not None:
            times.setdefault(r.target, []).append(r.restart_s)
    return {
        "config": {
            "rounds": cfg.rounds,
            "seed": cfg.seed,
            "clients": cfg.clients,
            "tp_side": cfg.tp_side,
            "inflight_deadline_s": cfg.inflight_deadline_s,
            "recover_timeout_s": cfg.recover_timeout_s,
            "server_args": list(cfg.server_args),
            "model_path": cfg.model_path,
            "policy": {
                "max_restarts": cfg.policy.max_restarts,
                "window_s": cfg.policy.window_s,
                "backoff_s": cfg.policy.backoff_s,
                "backoff_max_s": cfg.policy.backoff_max_s,
            },
        },
        "machine": {
            "cpu": _cpu_name(),
            "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "load_avg_end": list(os.getloadavg()),
        },
        "rounds_run": len(results),
        "rounds_ok": sum(r.ok for r in results),
        "kills": {f"{t}/{p}": n for (t, p), n in sorted(Counter((r.target, r.phase.value) for r in results).items())},
        "inflight": dict(inflight),
        "hung": sum(len(r.hung) for r in results),
        "restart_s": {
            t: {"n": len(v), "min": _r(min(v)), "median": _r(statistics.median(v)), "max": _r(max(v))}
            for t, v in sorted(times.items())
        },
        "leaks_found": sum(len(r.leaks) for r in results),
        "survivors_restarted": sum(len(r.survivors_restarted) for r in results),
        "supervisor_restarts": stack.restarts if stack is not None else {},
        "rounds": [r.as_dict() for r in results],
    }


def _cpu_name() -> str:
    from kvpipe.bench.engine import cpu_name  # here: that module imports torch

    return cpu_name()


def table(summary: dict[str, Any]) -> str:
    head = f"{'round':>5}  {'target':<8} {'phase':<9} {'ok':<4} {'restart s':>9} {'serving s':>9}  in flight"
    lines = [head]
    for r in summary["rounds"]:
        lines.append(
            f"{r['round']:>5}  {r['target']:<8} {r['phase']:<9} {'yes' if r['ok'] else 'NO':<4} "
            f"{_fmt(r['restart_s']):>9} {_fmt(r['first_success_s']):>9}  "
            + ", ".join(f"{k} {v}" for k, v in sorted(r["inflight"].items()))
        )
    lines.append(
        f"{summary['rounds_ok']}/{summary['rounds_run']} rounds ok; in flight at the kills: "
        + ", ".join(f"{k} {v}" for k, v in sorted(summary["inflight"].items()))
        + f"; hung {summary['hung']}; leaks {summary['leaks_found']}; "
        f"survivors restarted {summary['survivors_restarted']}"
    )
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--seed", type=int, default=d.seed, help="the order of the kills and where they land")
    p.add_argument("--clients", type=int, default=d.clients, help="client threads streaming through the router")
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
    p.add_argument("--model-path", default=None, help="HF checkpoint directory (default: the built-in tiny model)")
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
        model_path=args.model_path,
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
