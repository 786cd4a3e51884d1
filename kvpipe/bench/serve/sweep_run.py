"""`kvpipe bench serve` sweeps: a stack per mode started here (optionally across an emulated
link), every prompt length on each, one mode after the other or interleaved round by round; and
`--compare-colocated`, the same over the PD stack and a colocated server."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from kvpipe.bench.kv_bytes import ServedDtypes, kv_wire_bytes, state_bytes_per_request, with_draft_kv, with_mtp_kv
from kvpipe.bench.serve.chat_text import ChatText, open_chat_text
from kvpipe.bench.serve.compare import COMPARE_MODES, compare_rows, compare_table
from kvpipe.bench.serve.group_timeline import GroupTimeline, format_group_timeline, newest_group_timeline, with_planner
from kvpipe.bench.serve.plot import result_plot
from kvpipe.bench.serve.run import config_dict, emit, measure, summary_of, vocab_size, warm_up, workload_config
from kvpipe.bench.serve.spec_stats import reporting_spec
from kvpipe.bench.serve.stacks import Endpoint, StackOptions, default_stack_factory
from kvpipe.bench.serve.sweep import (
    SliceResult,
    SweepPoint,
    is_colocated,
    parse_modes,
    parse_prompt_lens,
    run_sweep,
    run_sweep_in_rounds,
    run_sweep_interleaved,
    server_flag,
    server_page_size,
)
from kvpipe.bench.serve.sweep_rows import sweep_rows
from kvpipe.bench.workload import WorkloadConfig, build_workload, split_rounds
from kvpipe.config import MTP_ALGORITHMS, ConfigError
from kvpipe.harness import driver
from kvpipe.harness.machine import load_average, machine_info
from kvpipe.harness.probe import (
    count_delta,
    read_debug_requests,
    read_num_groups,
    read_server_info,
    tail_delta,
    transfer_count_from_server_info,
    transfer_tail_from_server_info,
)
from kvpipe.harness.testbed import LinkTestbed, LinkTestbedError, parse_rate
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.draft.eagle import eagle_config
from kvpipe.model.presets import model_path_or_preset
from kvpipe.transfer.planning.wire_bytes import KVWireBytes

Reading = tuple[Any, Any]  # (transfer tail, transfer count) of a prefill at one time


def _readings(ep: Endpoint) -> Reading:
    """(transfer tail, transfer count) of the prefill now, from one /server_info fetch."""
    info = ep.call(read_server_info, ep.info_url)
    if info is None:
        return None, None
    return transfer_tail_from_server_info(info), transfer_count_from_server_info(info)


def _model_bytes(model_path: str, server_args: tuple[str, ...]) -> tuple[KVWireBytes | None, int]:
    """What a request of the model moves as the servers run it (their --dtype, --kv-cache-dtype,
    --page-size): its KV by prompt length and its state (unknown: None, 0)."""
    try:
        mc = model_config_of(model_path)
    except (ConfigError, OSError, KeyError, TypeError, ValueError):
        return None, 0
    flag = partial(server_flag, server_args)
    served = ServedDtypes.of(mc, flag("--dtype"), flag("--kv-cache-dtype"), flag("--device"))
    kv = kv_wire_bytes(mc, server_page_size(server_args), served.kv)
    draft_path = flag("--speculative-draft-model-path")
    if kv is not None and draft_path is not None:  # every server runs the draft: PD moves its KV too
        try:  # an EAGLE head's one layer of K/V moves like a one-layer draft model's (model/draft/eagle.py)
            eagle = (flag("--speculative-algorithm") or "").upper() == "EAGLE"
            draft = eagle_config(draft_path) if eagle else model_config_of(draft_path)
        except (ConfigError, OSError, KeyError, TypeError, ValueError):
            return None, 0
        # the draft's pool keeps its compute dtype (--kv-cache-dtype does not apply to it)
        kv = with_draft_kv(kv, draft, ServedDtypes.of(draft, flag("--dtype"), None, flag("--device")).model)
    algo = (flag("--speculative-algorithm") or "").upper()
    if kv is not None and draft_path is None and algo in MTP_ALGORITHMS:  # NEXTN: the MTP layer's KV moves too
        kv = with_mtp_kv(kv, mc, served.model)
    return kv, state_bytes_per_request(mc, served.model) or 0


class Sweep:
    """The measurements of one sweep: per (mode, prompt length), or per round when interleaved."""

    def __init__(
        self,
        args: argparse.Namespace,
        configs: dict[int, WorkloadConfig],
        text: ChatText | None = None,
        in_rounds: bool = False,
    ) -> None:
        self.args, self.configs, self.text = args, configs, text
        # a round is `concurrency` conversations (single turn: requests), never a split conversation;
        # `in_rounds`: a sequential run in the same rounds (--compare-colocated without --interleave)
        self.slices = (
            {n: split_rounds(build_workload(c, text), args.concurrency) for n, c in configs.items()}
            if args.interleave or in_rounds
            else {}
        )
        self.rounds = len(next(iter(self.slices.values()))) if self.slices else 0
        # (mode, prompt length) -> the newest layer-pipelined request's per-group timeline
        self.group_timelines: dict[tuple[str, int], GroupTimeline] = {}

    def _keep_group_timeline(self, ep: Endpoint, mode: str, n: int, groups: int | None) -> None:
        """After a PD measurement whose prefill ran layer groups: its newest request's timeline."""
        if ep.info_url is None or not groups or groups < 2:
            return
        g = newest_group_timeline(ep.call(read_debug_requests, ep.info_url))
        if g is not None:
            self.group_timelines[(mode, n)] = with_planner(g, ep.call(read_server_info, ep.info_url))

    def measure(self, ep: Endpoint, mode: str, n: int) -> tuple[dict, int | None, float | None, float | None]:
        pd = ep.info_url is not None and not is_colocated(mode)
        before: list[Reading] = []

        def read_before() -> None:
            if pd:
                before.append(_readings(ep))

        summary, _ = measure(ep.call, ep.url, self.configs[n], self.args, f"{mode} len={n}", read_before, self.text)
        if not pd:
            return summary, None, None, None
        (tail0, count0), (tail1, count1) = before[0], _readings(ep)
        count = count_delta(count0, count1)
        groups = ep.call(read_num_groups, ep.info_url)
        self._keep_group_timeline(ep, mode, n, groups)
        return (summary, groups, tail_delta(tail0, tail1), count.per_room if count else None)

    def measure_slice(self, ep: Endpoint, mode: str, n: int, r: int) -> SliceResult:
        args, desc = self.args, f"{mode} len={n} round {r + 1}/{self.rounds}"
        pd = ep.info_url is not None and not is_colocated(mode)
        if r == 0:
            warm_up(ep.call, ep.url, self.configs[n], args, desc, False, self.text)
        sub = self.slices[n][r].requests
        before = _readings(ep) if pd else None
        res = ep.call(driver.run, ep.url, sub, args.concurrency, args.timeout, not args.no_progress, desc)
        if before is None:
            return SliceResult(res.outcomes, res.duration_s)
        after = _readings(ep)
        groups = ep.call(read_num_groups, ep.info_url)
        self._keep_group_timeline(ep, mode, n, groups)
        return SliceResult(
            res.outcomes, res.duration_s, groups, tail_delta(before[0], after[0]), count_delta(before[1], after[1])
        )


def _reporting_threads(
    open_stack: Callable[[str], contextlib.AbstractContextManager[Endpoint]], into: dict[str, Any]
) -> Callable[[str], contextlib.AbstractContextManager[Endpoint]]:
    """`open_stack` that also records, per mode, each started server's /server_info cpu_threads."""

    @contextlib.contextmanager
    def opened(mode: str) -> Iterator[Endpoint]:
        with open_stack(mode) as ep:
            into[mode] = {name: (ep.call(read_server_info, url) or {}).get("cpu_threads") for name, url in ep.servers}
            yield ep

    return opened


def run_sweep_cmd(args: argparse.Namespace, compare: bool = False) -> int:
    """A sweep of --sweep-prompt-lens over --modes; `compare`: --prompt-lens over PD and colocated."""
    try:
        lens = parse_prompt_lens(args.prompt_lens if compare else args.sweep_prompt_lens)
        modes = list(COMPARE_MODES) if compare else parse_modes(args.modes)
        rate_bps = parse_rate(args.link_rate)[1] if args.link_rate else None
    except ValueError as e:
        raise SystemExit(f"kvpipe bench serve: {e}") from None
    model_path = model_path_or_preset(args.model_path)
    text = open_chat_text(model_path) if args.api == "chat" else None
    vocab = vocab_size(args, model_path, text)
    configs = {n: workload_config(args, vocab, n) for n in lens}  # same prompts for every mode
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpipe-bench-serve-")  # server logs, always kept
    threads: dict[str, Any] = {}  # mode -> server name -> the cpu_threads its /server_info reported
    speculative: dict[str, Any] = {}  # mode -> server name -> its speculative counts (bench/serve/spec_stats.py)
    load_before = load_average()
    opts = StackOptions(model_path, tuple(shlex.split(args.server_args)), log_dir, args.startup_timeout)
    # --compare-colocated sends the same rounds whether interleaved or not: its two orders must
    # give the same ratios (issue 31), so they may differ only in what shares the machine meanwhile
    sweep = Sweep(args, configs, text, in_rounds=compare)
    points: list[SweepPoint]
    try:
        with contextlib.ExitStack() as stack:
            tb = stack.enter_context(LinkTestbed(args.link_rate, mtu=args.link_mtu)) if args.link_rate else None
            factory = _reporting_threads(default_stack_factory(opts, tb), threads)
            factory = reporting_spec(factory, speculative)  # speculative servers: their acceptance
            if args.interleave:
                points = run_sweep_interleaved(lens, modes, factory, sweep.measure_slice, sweep.rounds, summary_of)
            elif compare:
                points = run_sweep_in_rounds(lens, modes, factory, sweep.measure_slice, sweep.rounds, summary_of)
            else:
                points = run_sweep(lens, modes, factory, sweep.measure)
    except (LinkTestbedError, RuntimeError, TimeoutError) as e:  # a stack that did not start
        raise SystemExit(f"kvpipe bench serve: {e} (server logs in {log_dir})") from None
    kv_wire, state_bytes = _model_bytes(model_path, opts.server_args)
    rows = sweep_rows(points, rate_bps, kv_wire, state_bytes)
    result = {
        "model_path": model_path,
        "log_dir": log_dir,
        "link_rate": args.link_rate or "loopback",
        "link_rate_bps": rate_bps,
        "link_mtu": args.link_mtu if args.link_rate else None,
        "modes": modes,
        "interleaved": args.interleave,
        "server_args": list(opts.server_args),
        "workload": config_dict(configs[lens[0]], args) | {"prompt_lens": lens},
        "rows": rows,
        "summaries": [
            {
                "prompt_len": p.prompt_len,
                "mode": p.mode,
                **p.summary,
                **({"round_output_throughput": list(p.round_throughput)} if p.round_throughput else {}),
            }
            for p in points
        ],
        "cpu_threads": threads,
        **({"speculative": speculative} if speculative else {}),
        "machine": machine_info(load_before),
        # one layer-pipelined request per (mode, prompt length): each group's compute end and the
        # writes in flight, from the prefill's own timestamps (bench/serve/group_timeline.py)
        "group_timelines": [
            {"mode": m, "prompt_len": n, **g.to_json()} for (m, n), g in sorted(sweep.group_timelines.items())
        ],
    }
    for (m, n), g in sorted(sweep.group_timelines.items()):
        print(format_group_timeline(f"{m} len={n}", g), file=sys.stderr)
    ok = 0 if all(p.summary["completed"] for p in points) else 1
    if compare:
        result["compare"] = compare_rows(points)
        servers = {**threads.get(COMPARE_MODES[0], {}), **threads.get(COMPARE_MODES[1], {})}
        emit(result, args, lambda path: result_plot(result, path), compare_table(result["compare"], servers))
        return ok
    emit(result, args, lambda path: result_plot(result, path))
    return ok
