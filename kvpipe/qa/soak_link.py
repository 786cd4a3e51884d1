"""`bench soak --link-fault SPEC`: the soak's stack across the link testbed (prefill on side a,
decode and sglang-router on side b: harness/testbed_stack.py) with a link fault (harness/
link_faults.py: loss, a partition, flaps; delay, jitter, reorder where the kernel has netem)
applied on a schedule while the measured load runs: `after_s` into the load, for its duration, then
healed.

What the fault gave, beside the soak's own checks (no hang, every failure clear, nothing leaked):
- exact: the successes of the native API (their output ids) sent again one at a time once the
  link is healed and the stack idle; a success whose tokens differ was served wrong;
- time to service after the heal: from the heal to the first probe served (HealProbe: a short
  request every PROBE_INTERVAL_S from the heal on, beside the load), and from the heal to the
  first load request sent after it from which every later one was served (with a closed-loop
  load this is mostly how long the requests the fault caught held their slots).

Root, iproute2 and nftables (netem for its kinds); the caller's thread runs inside side b.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpipe.harness.driver import run as run_requests
from kvpipe.harness.link_faults import FaultRun, LinkFault
from kvpipe.harness.outcome import Outcome
from kvpipe.harness.request import Api, Request
from kvpipe.harness.testbed import LinkSpec, LinkTestbed, inside_netns
from kvpipe.harness.testbed_stack import start_testbed_stack
from kvpipe.launch.stack import PDStack
from kvpipe.qa.checks import Check
from kvpipe.qa.soak_tally import Judgement, judge

PROBE_INTERVAL_S = 0.25
PROBE = Request(0, tuple(5 + i % 200 for i in range(64)), 4)  # a short native /generate


@dataclass(frozen=True)
class LinkOptions:
    fault: LinkFault
    rate: str = "100mbit"  # the testbed link's tbf rate
    after_s: float = 5.0  # seconds into the measured load before the fault starts
    rto_max_ms: int | None = None  # TCP's retransmission timeout cap in the testbed (None: the kernel's)


@contextlib.contextmanager
def testbed_stack(
    opts: LinkOptions,
    model_path: str | None,
    server_args: Sequence[str],
    prefill_args: Sequence[str],
    log_dir: str,
    timeout_s: float,
) -> Iterator[tuple[PDStack, LinkSpec]]:
    """The stack across a fresh testbed and its link, the calling thread inside side b for the
    block; the testbed and its namespaces are removed at exit, also on failure."""
    testbed = LinkTestbed(opts.rate, state_dir=Path(log_dir) / "testbed", rto_max_ms=opts.rto_max_ms)
    with testbed as tb, inside_netns(tb.ns_b):
        with start_testbed_stack(
            tb, model_path, server_args=server_args, prefill_args=prefill_args, log_dir=log_dir, timeout_s=timeout_s
        ) as stack:
            yield stack, tb.spec


class HealProbe:
    """Beside the load, from the heal on: a short request every PROBE_INTERVAL_S until one is
    served. Its own thread (created inside the caller's namespace, so it is in there too) and its
    own connection, so a load whose every slot waits on requests caught by the fault does not delay it."""

    def __init__(self, url: str, run: FaultRun, deadline_s: float) -> None:
        self.url, self.run, self.deadline_s = url, run, deadline_s
        self.served_s: float | None = None  # heal -> the first probe served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, name="heal-probe", daemon=True)

    def __enter__(self) -> HealProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Wait for the heal and a probe served (each bounded), then stop."""
        self._thread.join(self._heal_bound_s() + self.deadline_s + 30.0)
        self._stop.set()
        self._thread.join(30.0)

    def _heal_bound_s(self) -> float:
        # the heal's nft commands took 43 s on a host at load 27 near OOM: wait well past the duration
        return self.run.start_after_s + self.run.fault.duration_s + 120.0

    def _probe(self) -> None:
        end = time.monotonic() + self._heal_bound_s()
        while self.run.healed_at is None and time.monotonic() < end:
            if self._stop.wait(0.05):
                return
        self.served_s = probe_served_s(self.url, self.run.healed_at, self.deadline_s, self._stop)


def served(o: Outcome) -> bool:
    return judge(o) in (Judgement.SUCCESS, Judgement.DISCONNECTED)


def full_service_s(outcomes: Sequence[Outcome], healed_at: float | None) -> float | None:
    """Seconds from the heal to the send of the first load request after it from which every
    request sent later was served (0 when all were); None: no request was sent after the heal."""
    if healed_at is None:
        return None
    after = sorted((o for o in outcomes if o.start_s >= healed_at), key=lambda o: o.start_s)
    if not after:
        return None
    first_ok = len(after)
    for i in range(len(after) - 1, -1, -1):
        if not served(after[i]):
            break
        first_ok = i
    if first_ok == len(after):
        return None  # the last one sent failed: not back to full service within the load
    return max(0.0, after[first_ok].start_s - healed_at)


def probe_served_s(
    url: str, healed_at: float | None, deadline_s: float, stop: threading.Event | None = None
) -> float | None:
    """Send PROBE every PROBE_INTERVAL_S until one is served (bounded by `deadline_s`, and by
    `stop`); seconds from the heal to that success, None when none was."""
    end = time.monotonic() + deadline_s
    stop = stop or threading.Event()
    while healed_at is not None and time.monotonic() < end and not stop.is_set():
        res = run_requests(url, [PROBE], 1, min(30.0, deadline_s), progress=False)
        if res.outcomes and res.outcomes[0].ok:
            return max(0.0, time.monotonic() - healed_at)
        stop.wait(PROBE_INTERVAL_S)
    return None


def replay_exact(url: str, outcomes: Sequence[Outcome], deadline_s: float) -> dict[str, int]:
    """Send the native-API successes again one at a time (the link healed, the stack idle) and
    compare their output ids: {"checked", "exact", "differ", "failed"} (failed: the replay itself)."""
    done = [o for o in outcomes if o.ok and o.output_ids and o.request.api is Api.GENERATE]
    reqs = [Request(i, o.request.prompt, o.request.max_tokens, stream=False) for i, o in enumerate(done)]
    res = run_requests(url, reqs, 1, deadline_s, progress=False) if reqs else None
    counts = {"checked": len(done), "exact": 0, "differ": 0, "failed": 0}
    for o, again in zip(done, res.outcomes if res else []):
        key = "failed" if not again.ok else ("exact" if again.output_ids == o.output_ids else "differ")
        counts[key] += 1
    return counts


def link_result(
    run: FaultRun, outcomes: Sequence[Outcome], load_end: float, probe_s: float | None, exact: dict[str, int]
) -> tuple[dict[str, Any], list[Check]]:
    """The result's "link_fault" entry and its checks."""
    t0 = min((o.start_s for o in outcomes), default=load_end)
    applied, healed = run.applied_at, run.healed_at
    info = {
        "fault": run.fault.label,
        "applied_s": None if applied is None else round(applied - t0, 2),
        "healed_s": None if healed is None else round(healed - t0, 2),
        "load_s": round(load_end - t0, 2),
        "probe_served_after_heal_s": _round(probe_s),
        "load_served_after_heal_s": _round(full_service_s(outcomes, healed)),
        "replay": exact,
        "error": None if run.error is None else f"{type(run.error).__name__}: {run.error}",
    }
    checks = [
        Check("link fault applied and healed", run.error is None and healed is not None, str(info["error"] or "")),
        Check(
            "link fault during the load",
            applied is not None and applied < load_end,
            f"applied {info['applied_s']} s, load ended {info['load_s']} s",
        ),
        Check(
            "served again after the heal", probe_s is not None, f"a probe {info['probe_served_after_heal_s']} s after"
        ),
        Check("successes exact", exact["differ"] == 0 and exact["failed"] == 0, f"{exact}"),
    ]
    return info, checks


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)
