"""A local PD stack (prefill + decode + sglang-router, Mooncake over loopback TCP) for the PD
integration tests: handles on each server, restarts on the same ports, direct requests."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpipe.launch.process import stop_process, wait_healthy
from kvpipe.launch.stack import PDStack
from kvpipe.launch.start import start_pd_stack
from kvpipe.qa.chaos import child_pids
from tests.helpers.server import ServerProc, sse_events

_rooms = itertools.count(random.Random().randrange(1 << 40))


@dataclass
class Stack:
    pd: PDStack
    log_dir: Path

    @property
    def router(self) -> str:
        return self.pd.router_url

    def server(self, name: str) -> ServerProc:
        i, url = {"prefill": (0, self.pd.prefill_url), "decode": (1, self.pd.decode_url)}[name]
        return ServerProc(url, self.pd.procs[i], self.log_dir / f"{name}.log")

    @property
    def prefill(self) -> ServerProc:
        return self.server("prefill")

    @property
    def decode(self) -> ServerProc:
        return self.server("decode")

    def restart(self, name: str, *extra: str, timeout_s: float = 120.0) -> None:
        """Start the killed server again with the same command line (same ports) plus `extra` flags."""
        i = {"prefill": 0, "decode": 1}[name]
        assert self.pd.procs[i].poll() is not None, f"{name} is still running"
        spec = self.pd.specs[i]  # its environment too: the stack's auth token
        self.pd.procs[i] = dataclasses.replace(spec, cmd=(*spec.cmd, *extra)).spawn()
        srv = self.server(name)
        wait_healthy(srv.url + "/health", timeout_s, [srv.proc])

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.log_dir.glob("*.log"))
        )

    def close(self) -> None:
        self.pd.close()


def start_stack(
    model_dir: Path,
    log_dir: Path,
    *server_args: str,
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    timeout_s: float = 180.0,
) -> Stack:
    pd = start_pd_stack(
        str(model_dir),
        server_args=list(server_args),
        prefill_args=list(prefill_args),
        decode_args=list(decode_args),
        log_dir=str(log_dir),
        timeout_s=timeout_s,
    )
    return Stack(pd, log_dir)


def stop(proc: subprocess.Popen) -> None:
    stop_process(proc)


def greedy(max_new_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **kw}


def generate(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POST /generate; a streamed answer is folded into the final event (plus the event count).

    A router that has no healthy worker yet (a server restarted a moment ago: the router's next
    health check re-admits it within ROUTER_RECOVERY_FLAGS' 2 s checks) answers 503 before choosing any
    worker, so nothing ran: that answer is retried for up to 30 s."""
    if not body.get("stream"):
        deadline = time.monotonic() + 30.0
        while True:
            r = httpx.post(url + "/generate", json=body, timeout=timeout_s)
            if r.status_code != 503 or "server_selection_failed" not in r.text or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        return r.json()
    events = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=timeout_s) as r:
        assert r.status_code == 200, r.read()
        for ev in sse_events(r.iter_lines()):
            events.append(ev)
    assert events and events[-1] == "[DONE]", events[-3:]
    last = events[-2]
    assert isinstance(last, dict), events[-3:]  # the final chunk, not a second "[DONE]"
    final = dict(last)
    final["num_events"] = len(events) - 1
    return final


def pd_body(stack: Stack, body: dict[str, Any], room: int | None = None) -> dict[str, Any]:
    """A request body as sglang-router would send it to one of the servers directly."""
    return {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": stack.pd.bootstrap_port,
        "bootstrap_room": next(_rooms) if room is None else room,
    }


def wait_for(fn, timeout_s: float, what: str, interval_s: float = 0.1):
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def disagg_stats(srv: ServerProc) -> dict[str, Any]:
    return srv.engine_stats()["disaggregation"]


def dumps(x: Any) -> str:
    return json.dumps(x)[:400]


# ---- PD stacks with tensor parallelism ---------------------------------------------------------

TP_PS = 16  # the page size of start_tp_stack's servers
TP_FLAGS = [
    "--page-size",
    str(TP_PS),
    "--max-total-tokens",
    "8192",
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "30",
    "--disaggregation-transfer-timeout",
    "3",
]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def close_and_check_no_orphans(stack: Stack) -> None:
    pids = [p for proc in stack.pd.procs[:2] for p in child_pids(proc.pid)]
    stack.close()
    wait_for(lambda: not any(alive(p) for p in pids), 20, f"TP workers {pids} to exit")


def start_tp_stack(model: Path, tmp: Path, p_tp: int, d_tp: int, extra: tuple[str, ...]) -> Stack:
    """A PD stack on TP_FLAGS (page size TP_PS) plus `extra`, prefill TP `p_tp` and decode TP
    `d_tp`: each server has its TP children."""
    s = start_stack(
        model, tmp, *TP_FLAGS, *extra, prefill_args=("--tp-size", str(p_tp)), decode_args=("--tp-size", str(d_tp))
    )
    try:
        assert len(child_pids(s.pd.procs[0].pid)) == p_tp - 1
        assert len(child_pids(s.pd.procs[1].pid)) == d_tp - 1
    except BaseException:
        s.close()
        raise
    return s
