"""Sweep bookkeeping: modes and their server flags, and the (prompt_len, mode) loops.

Plain Python: the loop takes the stack factory and the measurement as callables, so it runs in
tests without servers. Modes:
  inproc        colocated server: the transfer costs nothing (the reference)
  pd            PD as `kvpipe launch` starts it: server defaults, no mode flags
  baseline      PD with the plain transfer (one layer group)
  pipelined     PD with layer-pipelined transfer, group count chosen by the server
  pipelined-N   PD with layer-pipelined transfer forced to N groups
  decode-cache  PD with the plain transfer and the decode radix cache: the prefill sends only the
                KV past the prefix the decode holds (compare with baseline on shared-prefix and
                multi-turn workloads; the prefill's own prefix cache is on in every mode)
  pd-norecord, inproc-norecord
                pd and inproc with --disable-request-metrics: no request timelines or latency
                histograms (interleave with pd / inproc: what recording costs, same run)
  pd-nocache    baseline with --disable-radix-cache on both servers: every turn recomputes and
                resends its whole prompt (interleave with decode-cache: both caches' gain, same run)
  inproc-mixed  inproc with --enable-mixed-chunk: decoders ride along prefill chunks (interleave
                with inproc: the policy's TTFT and TPOT, same run); inproc-mixed-N also sets
                --chunked-prefill-size N (the step's token budget)
The rows of a sweep's result are sweep_rows.py.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpipe.bench.rotation import rotated
from kvpipe.config import CacheConfig
from kvpipe.harness.outcome import Outcome
from kvpipe.harness.probe import TransferCount

E = TypeVar("E")
BASELINE, PIPELINED, INPROC, DECODE_CACHE, PD = "baseline", "pipelined", "inproc", "decode-cache", "pd"
# a colocated server with its prefix cache off (--disable-radix-cache): the cache's own gain, same run
INPROC_NOCACHE = "inproc-nocache"
# per-request recording off (--disable-request-metrics): what timelines and histograms cost, same run
PD_NORECORD, INPROC_NORECORD = "pd-norecord", "inproc-norecord"
NORECORD_FLAGS = ("--disable-request-metrics",)
# PD with no prefix cache on either server (baseline's transfer): what both caches save, same run
PD_NOCACHE = "pd-nocache"
# a colocated server whose prefill steps carry the decoders' tokens (--enable-mixed-chunk), same run
INPROC_MIXED = "inproc-mixed"
COLOCATED_MODES = (INPROC, INPROC_NOCACHE, INPROC_NORECORD, INPROC_MIXED)
PLAIN_MODES = (
    BASELINE,
    PIPELINED,
    INPROC,
    DECODE_CACHE,
    PD,
    INPROC_NOCACHE,
    PD_NORECORD,
    INPROC_NORECORD,
    PD_NOCACHE,
    INPROC_MIXED,
)
_COLOCATED_FLAGS = {
    INPROC_NOCACHE: ("--disable-radix-cache",),
    INPROC_NORECORD: NORECORD_FLAGS,
    INPROC_MIXED: ("--enable-mixed-chunk",),
}
_PIPELINED_N = re.compile(r"^pipelined-(\d+)$")
_MIXED_N = re.compile(r"^inproc-mixed-(\d+)$")


def is_pipelined(mode: str) -> bool:
    return mode == PIPELINED or _PIPELINED_N.match(mode) is not None


def parse_modes(spec: str) -> list[str]:
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    for m in modes:
        numbered = _PIPELINED_N.match(m) or _MIXED_N.match(m)
        if m not in PLAIN_MODES and not (numbered and int(numbered.group(1)) >= 1):
            raise ValueError(
                f"unknown mode {m!r}: choose from baseline, pipelined, pipelined-N, decode-cache, pd, inproc, "
                "inproc-nocache, pd-norecord, inproc-norecord, pd-nocache, inproc-mixed, inproc-mixed-N"
            )
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"modes must be a non-empty list without repeats, got {spec!r}")
    return modes


@dataclass(frozen=True)
class ModeFlags:
    """Server flags of a PD mode."""

    both: tuple[str, ...]  # for the prefill and the decode
    decode: tuple[str, ...] = ()  # for the decode only


def colocated_flags(mode: str) -> tuple[str, ...]:
    """Extra server flags of a colocated mode."""
    m = _MIXED_N.match(mode)
    if m:
        return (*_COLOCATED_FLAGS[INPROC_MIXED], "--chunked-prefill-size", m.group(1))
    return _COLOCATED_FLAGS.get(mode, ())


def is_colocated(mode: str) -> bool:
    return mode in COLOCATED_MODES or _MIXED_N.match(mode) is not None


def mode_server_flags(mode: str) -> ModeFlags | None:
    """Server flags of a PD mode; None for the colocated modes (colocated_flags)."""
    if is_colocated(mode):
        return None
    if mode == PD:
        return ModeFlags(())
    if mode == PD_NORECORD:
        return ModeFlags(NORECORD_FLAGS)
    if mode == BASELINE:
        return ModeFlags(("--disaggregation-layer-groups", "1"))
    if mode == PD_NOCACHE:
        return ModeFlags(("--disaggregation-layer-groups", "1", "--disable-radix-cache"))
    if mode == DECODE_CACHE:
        return ModeFlags(("--disaggregation-layer-groups", "1"), ("--disaggregation-enable-decode-radix-cache",))
    if mode == PIPELINED:
        return ModeFlags(("--disaggregation-layer-groups", "auto"))
    m = _PIPELINED_N.match(mode)
    if m:
        return ModeFlags(("--disaggregation-layer-groups", m.group(1)))
    raise ValueError(f"unknown mode {mode!r}")


def parse_prompt_lens(spec: str) -> list[int]:
    try:
        lens = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"prompt lengths: expected N,N,..., got {spec!r}") from None
    if not lens or min(lens) < 1:
        raise ValueError(f"prompt lengths must be positive, got {spec!r}")
    return lens


@dataclass(frozen=True)
class SweepPoint:
    prompt_len: int
    mode: str
    summary: Mapping[str, Any]  # kvpipe.bench.latency.summarize() of this point
    num_groups: int | None = None
    # median over requests (rounds) of the KV transfer time left after the prefill forward, from
    # the prefill's own clock: exposed transfer without the compute noise between processes
    transfer_tail_ms: float | None = None
    # KV bytes the prefill wrote per request that succeeded (PD modes)
    kv_bytes_per_request: float | None = None
    # interleaved sweeps: each round's output tokens per second, in round order (modes pair up by
    # round: the spread of their ratios is the run's noise)
    round_throughput: tuple[float, ...] = ()


def run_sweep(
    prompt_lens: Sequence[int],
    modes: Sequence[str],
    open_stack: Callable[[str], AbstractContextManager[E]],
    measure: Callable[[E, str, int], tuple[Any, ...]],
) -> list[SweepPoint]:
    """One stack per mode (started once, stopped before the next), every prompt length on it.
    `measure` returns (summary, num_groups[, transfer_tail_ms[, kv_bytes_per_request]])."""
    points = []
    for mode in modes:
        with open_stack(mode) as endpoint:
            for n in prompt_lens:
                points.append(SweepPoint(n, mode, *measure(endpoint, mode, n)))
    return points


@dataclass(frozen=True)
class SliceResult:
    """One round of an interleaved sweep on one mode: its requests' outcomes and wall time."""

    records: Sequence[Outcome]
    duration_s: float
    num_groups: int | None = None
    transfer_tail_ms: float | None = None  # mean over the slice's rooms (PD modes)
    transfer: TransferCount | None = None  # what the prefill wrote during the slice (PD modes)


def run_sweep_interleaved(
    prompt_lens: Sequence[int],
    modes: Sequence[str],
    open_stack: Callable[[str], AbstractContextManager[E]],
    measure_slice: Callable[[E, str, int, int], SliceResult],
    rounds: int,
    summarize: Callable[[Sequence[Outcome], float], Mapping[str, Any]],
) -> list[SweepPoint]:
    """Every mode's stack runs at once; per prompt length, `rounds` rounds each run one slice of
    the workload (`measure_slice(endpoint, mode, prompt_len, round)`) on every mode in turn.
    On a shared, noisy machine a load change then hits all modes alike instead of the one mode
    that happened to run at the time, which is what the side-by-side ratios need."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    points = []
    with ExitStack() as stacks:
        eps = {m: stacks.enter_context(open_stack(m)) for m in modes}
        for n in prompt_lens:
            parts: dict[str, list[SliceResult]] = {m: [] for m in modes}
            for r in range(rounds):
                for m in rotated(modes, r):  # no mode always runs first, right after a mode switch
                    parts[m].append(measure_slice(eps[m], m, n, r))
            points += [_point_of(n, m, parts[m], summarize) for m in modes]
    return points


def _point_of(
    n: int, m: str, parts: Sequence[SliceResult], summarize: Callable[[Sequence[Outcome], float], Mapping[str, Any]]
) -> SweepPoint:
    """One mode's rounds at one prompt length as a SweepPoint: every round's outcomes together."""
    records = [rec for p in parts for rec in p.records]
    groups = next((p.num_groups for p in reversed(parts) if p.num_groups is not None), None)
    tails = [p.transfer_tail_ms for p in parts if p.transfer_tail_ms is not None]
    counts = [p.transfer for p in parts if p.transfer is not None]
    kv = sum(counts[1:], counts[0]).per_room if counts else None
    per_round = [summarize(p.records, p.duration_s).get("output_throughput") for p in parts]
    return SweepPoint(
        n,
        m,
        summarize(records, sum(p.duration_s for p in parts)),
        groups,
        statistics.median(tails) if tails else None,
        kv,
        round_throughput=tuple(float(t) for t in per_round if t is not None),
    )


def run_sweep_in_rounds(
    prompt_lens: Sequence[int],
    modes: Sequence[str],
    open_stack: Callable[[str], AbstractContextManager[E]],
    measure_slice: Callable[[E, str, int, int], SliceResult],
    rounds: int,
    summarize: Callable[[Sequence[Outcome], float], Mapping[str, Any]],
) -> list[SweepPoint]:
    """The rounds of `run_sweep_interleaved`, one mode after the other: one stack up at a time
    (started, every prompt length's rounds in order, stopped). The workload reaches each stack in
    the same rounds as interleaved (`concurrency` requests sent together, the next round after the
    last one ended), so the two orders differ only in what shares the machine meanwhile; a plain
    `run_sweep` keeps `concurrency` requests in flight and starts each as one ends, a different load."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    points = []
    for m in modes:
        with open_stack(m) as ep:
            for n in prompt_lens:
                points.append(_point_of(n, m, [measure_slice(ep, m, n, r) for r in range(rounds)], summarize))
    return points


def server_flag(server_args: Sequence[str], name: str) -> str | None:
    """The last value of `--name` among the servers' flags (`--name V` or `--name=V`), else None."""
    value = None
    for i, a in enumerate(server_args):
        if a == name and i + 1 < len(server_args):
            value = server_args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def server_page_size(server_args: Sequence[str]) -> int:
    """The servers' --page-size (tokens per KV page) among their flags, else the default."""
    size = server_flag(server_args, "--page-size")
    return CacheConfig().page_size if size is None else int(size)
