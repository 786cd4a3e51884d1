"""`kvpipe bench soak`: many mixed requests with injected faults through the local PD stack, then
leak checks.

    kvpipe bench soak                       # 1,000 requests, c=16, prompts 1..4096, 5% / 10% faults
    kvpipe bench soak --num-requests 60 --concurrency 4 --prompt-max 1024 --out soak.json
    kvpipe bench soak --link-fault partition:6s --failure-prob 0 ...   # across the link testbed (root)

Starts prefill + decode + sglang-router (`start_pd_stack`, the prefill with
--disaggregation-failure-prob F), warms up, takes a baseline (both servers' pools from
/server_info and their process groups' RSS / fds / threads from /proc), sends the planned
requests (soak_plan.py) with a deadline each, samples the processes meanwhile, waits (bounded)
for both servers to be idle and checks everything is back. A request that neither finished nor
failed by its deadline is a hang. Exit status 1 when any check failed; the JSON holds the counts,
latencies, checks and resource series. With --link-fault the stack runs across the link testbed
and the fault is applied while the load runs (soak_link.py: what it adds to the result).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from kvpipe.harness.driver import drive
from kvpipe.harness.link_faults import FaultRun, LinkFault, netem_missing, nft_missing
from kvpipe.harness.machine import load_average, machine_info
from kvpipe.harness.probe import engine_stats
from kvpipe.harness.request import Request
from kvpipe.harness.sigterm import sigterm_as_exit
from kvpipe.harness.testbed import LinkSpec
from kvpipe.launch.stack import PDStack
from kvpipe.launch.start import start_pd_stack
from kvpipe.model.presets import model_path_or_preset
from kvpipe.qa.checks import Check, checks_dict, failed, verdict
from kvpipe.qa.leaks import wait_idle
from kvpipe.qa.soak_link import HealProbe, LinkOptions, link_result, replay_exact, testbed_stack
from kvpipe.qa.soak_plan import Bounds, SoakConfig, plan_requests, plan_warmup
from kvpipe.qa.soak_report import room_deltas, table
from kvpipe.qa.soak_resources import ResourceSeries, Sampler, resource_checks
from kvpipe.qa.soak_tally import Tally
from kvpipe.server.client_keys import client_headers

SERVERS = ("prefill", "decode")


def add_args(p: argparse.ArgumentParser) -> None:
    d, b = SoakConfig(), Bounds()
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=d.num_requests, help="requests in all")
    w.add_argument("--concurrency", type=int, default=d.concurrency, help="max requests in flight")
    w.add_argument("--prompt-min", type=int, default=d.prompt_min, help="shortest prompt (tokens or characters)")
    w.add_argument("--prompt-max", type=int, default=d.prompt_max, help="longest prompt (tokens or characters)")
    w.add_argument("--output-max", type=int, default=d.output_max, help="outputs are drawn in 1..this tokens")
    w.add_argument(
        "--failure-prob",
        type=float,
        default=d.failure_prob,
        help="the prefill fails each KV transfer batch with this probability",
    )
    w.add_argument(
        "--disconnect-prob",
        type=float,
        default=d.disconnect_prob,
        help="share of requests whose stream we close after a few events",
    )
    w.add_argument("--seed", type=int, default=d.seed, help="workload and failure-injection seed")
    w.add_argument("--deadline", type=float, default=d.deadline_s, help="seconds per request before it is a hang")
    w.add_argument(
        "--warmup-requests",
        type=int,
        default=d.warmup_requests,
        help="unmeasured drawn requests before the baseline, after --concurrency of the longest "
        "prompts (0: no warm-up)",
    )
    c = p.add_argument_group("checks")
    c.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="seconds to wait after the run for both servers to be idle",
    )
    c.add_argument(
        "--sample-interval", type=float, default=d.sample_interval_s, help="seconds between resource samples"
    )
    c.add_argument("--max-rss-growth-mb", type=float, default=b.rss_growth_mb, help="per server, final - baseline")
    c.add_argument("--max-fd-delta", type=int, default=b.fd_delta, help="per server, open files final - baseline")
    c.add_argument("--max-thread-delta", type=int, default=b.thread_delta, help="per server, threads final - baseline")
    s = p.add_argument_group("stack")
    s.add_argument("--model-path", default=None, help="checkpoint directory or .gguf file (default: tiny preset)")
    s.add_argument("--server-args", default="", help="extra flags for both servers, one string")
    s.add_argument("--log-dir", default=None, help="server logs (default: a new temp dir)")
    s.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for the stack to start")
    f = p.add_argument_group("link fault (root, iproute2, nftables; netem for delay, jitter, reorder)")
    f.add_argument(
        "--link-fault",
        default=None,
        metavar="SPEC",
        help="run the stack across the link testbed and apply this fault during the load: loss:1%%:30s, "
        "partition:6s, flap:1s/2s:20s, delay:50ms:30s, jitter:50ms/10ms:30s, reorder:25%%/10ms:30s",
    )
    f.add_argument("--link-rate", default=LinkOptions.rate, help="the testbed link's rate (tbf), e.g. 100mbit")
    f.add_argument(
        "--link-fault-after", type=float, default=LinkOptions.after_s, help="seconds into the load the fault starts"
    )
    f.add_argument(
        "--link-rto-max-ms",
        type=int,
        default=None,
        help="cap TCP's retransmission timeout in the testbed (net.ipv4.tcp_rto_max_ms; default: the kernel's 120 s)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object")
    o.add_argument("--out", default=None, help="write the JSON result to this file")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    try:
        return SoakConfig(
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            prompt_min=args.prompt_min,
            prompt_max=args.prompt_max,
            output_max=args.output_max,
            failure_prob=args.failure_prob,
            disconnect_prob=args.disconnect_prob,
            seed=args.seed,
            deadline_s=args.deadline,
            idle_timeout_s=args.idle_timeout,
            sample_interval_s=args.sample_interval,
            warmup_requests=args.warmup_requests,
            bounds=Bounds(args.max_rss_growth_mb, args.max_fd_delta, args.max_thread_delta),
        )
    except ValueError as e:
        raise SystemExit(f"kvpipe bench soak: {e}") from None


def link_from_args(args: argparse.Namespace) -> LinkOptions | None:
    if args.link_fault is None:
        return None
    try:
        link = LinkOptions(
            LinkFault.parse(args.link_fault), args.link_rate, args.link_fault_after, args.link_rto_max_ms
        )
    except ValueError as e:
        raise SystemExit(f"kvpipe bench soak: {e}") from None
    why = netem_missing() if link.fault.kind.netem else nft_missing()
    if why is not None:  # before a stack is started for nothing
        raise SystemExit(f"kvpipe bench soak: cannot apply {link.fault.label}: {why}")
    return link


@contextlib.contextmanager
def _stack(
    link: LinkOptions | None,
    model_path: str | None,
    server_args: list[str],
    prefill_args: list[str],
    log_dir: str,
    timeout_s: float,
) -> Iterator[tuple[PDStack, LinkSpec | None]]:
    """`kvpipe launch`'s local stack, or (with `link`) the stack across the link testbed."""
    if link is not None:
        with testbed_stack(link, model_path, server_args, prefill_args, log_dir, timeout_s) as (stack, spec):
            yield stack, spec
        return
    with start_pd_stack(
        model_path,
        server_args=server_args,
        prefill_args=prefill_args,
        log_dir=log_dir,
        timeout_s=timeout_s,
        api_keys=True,  # as `kvpipe launch`: its clients find the keys by URL (server/client_keys.py)
    ) as stack:
        yield stack, None


def _model_name(url: str) -> str:
    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10.0, headers=client_headers(url=url))
    return str(r.json()["data"][0]["id"])


def _drive(
    url: str, reqs: list[Request], model: str, cfg: SoakConfig, tally: Tally, progress: bool, desc: str
) -> float:
    t0 = time.monotonic()
    asyncio.run(
        drive(
            url,
            reqs,
            cfg.concurrency,
            cfg.deadline_s,
            model=model,
            progress=progress,
            desc=desc,
            on_outcome=tally.add,
            clock=time.monotonic,  # the link fault's clock
        )
    )
    return time.monotonic() - t0


def run_soak(
    cfg: SoakConfig,
    model_path: str | None,
    server_args: list[str],
    log_dir: str,
    startup_timeout_s: float,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    link: LinkOptions | None = None,
) -> dict[str, Any]:
    """Start the stack, warm up, run (with `link`: across the testbed, the fault applied during
    the run), check; returns the result (see the module doc)."""
    prefill_args = [
        "--disaggregation-failure-prob",
        str(cfg.failure_prob),
        "--disaggregation-failure-seed",
        str(cfg.seed),
    ]
    planned = plan_requests(cfg)
    link_info: dict[str, Any] | None = None
    link_checks: list[Check] = []
    with _stack(link, model_path, server_args, prefill_args, log_dir, startup_timeout_s) as (stack, spec):
        urls = {"prefill": stack.prefill_url, "decode": stack.decode_url}
        pgids = {"prefill": stack.procs[0].pid, "decode": stack.procs[1].pid}  # each leads its session
        model = _model_name(stack.prefill_url)
        t0 = time.monotonic()
        if cfg.warmup_requests:
            warm = Tally()
            _drive(stack.router_url, plan_warmup(cfg), model, cfg, warm, progress, "soak warm-up")
            log(f"warm-up: {warm.by_outcome()}")
        # the baseline: idle pools (no baseline yet: the zero/full rules) and process readings
        warm_idle = wait_idle(urls, cfg.idle_timeout_s)
        baselines = {name: engine_stats(u) or {} for name, u in urls.items()}
        series = {name: ResourceSeries() for name in SERVERS}
        sampler = Sampler(pgids, series, t0, cfg.sample_interval_s)
        for name, s in sampler.sample().items():
            series[name].baseline = s
        tally = Tally()
        fault = FaultRun(spec, link.fault, link.after_s) if link is not None and spec is not None else None
        probe = HealProbe(stack.router_url, fault, cfg.deadline_s) if fault is not None else None
        with sampler, fault or contextlib.nullcontext(), probe or contextlib.nullcontext():
            duration = _drive(stack.router_url, planned, model, cfg, tally, progress, "soak")
            load_end = time.monotonic()
        probe_s = probe.served_s if probe is not None else None
        idle = wait_idle(urls, cfg.idle_timeout_s, baselines)
        final_stats = idle.stats
        for name, s in sampler.sample().items():
            series[name].final = s
        if fault is not None:
            exact = replay_exact(stack.router_url, tally.outcomes, cfg.deadline_s)
            link_info, link_checks = link_result(fault, tally.outcomes, load_end, probe_s, exact)
        alive = [
            Check(f"{name} alive", p.poll() is None, f"exit code {p.poll()}")
            for name, p in zip(("prefill", "decode", "router"), stack.procs)
        ]
    unwarmed = cfg.concurrency - cfg.warmup_requests  # connections the warm-up did not open
    checks = [
        *tally.checks(len(planned), cfg.failure_prob > 0 or link is not None),
        *idle.checks,
        *alive,
        *(c for name in SERVERS for c in resource_checks(name, series[name], cfg.bounds, unwarmed)),
        *link_checks,
    ]
    if not warm_idle.ok:
        checks.append(Check("idle after warm-up", False, "; ".join(failed(warm_idle.checks))))
    return {
        "config": asdict(cfg),
        "server_args": server_args,
        "log_dir": log_dir,
        "duration_s": round(duration, 1),
        "idle_wait_s": round(idle.waited_s, 1),
        "counts": {"planned": len(planned), "by_outcome": tally.by_outcome(), "by_kind": tally.by_kind()},
        "latency_ms": tally.latency_ms(),
        "messages": tally.messages(),
        "transfer_rooms": {name: room_deltas(baselines[name], final_stats.get(name) or {}) for name in SERVERS},
        "link_fault": link_info,
        "checks": checks_dict(checks),
        "ok": verdict(checks),
        "pools": {"baseline": baselines, "final": final_stats},
        "resources": {name: series[name].to_dict() for name in SERVERS},
    }


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    cfg = config_from_args(args)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpipe-bench-soak-")
    load_before = load_average()
    with sigterm_as_exit():
        try:
            result = run_soak(
                cfg,
                model_path_or_preset(args.model_path),
                shlex.split(args.server_args),
                log_dir,
                args.startup_timeout,
                not args.no_progress,
                link=link_from_args(args),
            )
        except (RuntimeError, TimeoutError) as e:  # a stack that did not start
            raise SystemExit(f"kvpipe bench soak: {e} (server logs in {log_dir})") from None
    result["machine"] = machine_info(load_before)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else table(result))
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench soak", description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
