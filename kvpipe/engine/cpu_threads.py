"""How many torch CPU threads a server process (and each of its TP ranks) runs.

torch starts one intra-op thread per core by default. Two servers on one machine (a local PD
stack) then run twice as many busy threads as there are cores, and OpenMP threads that spin
while waiting for their peers turn that into a many-fold slowdown. A server therefore takes
`--cpu-threads N` (`kvpipe launch` gives prefill and decode disjoint shares of the cores), and
without it the cores it may run on (its CPU affinity) split among its TP ranks.

`plan_cpu_threads` is pure; `apply_cpu_threads` is the one place that sets torch's counts.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvpipe.config import ServerConfig


class ThreadSource(str, Enum):
    FLAG = "flag"  # --cpu-threads
    AFFINITY = "affinity"  # the cores of the process's CPU affinity


# The engine runs no inter-op parallel work (no torch.jit.fork); torch's default pool would hold
# one more idle thread per core.
INTEROP_THREADS = 1


@dataclass(frozen=True)
class CpuThreads:
    """The torch threads of one server: `per_rank` intra-op threads in each of `tp_size` ranks."""

    per_rank: int
    tp_size: int
    source: ThreadSource
    cores: tuple[int, ...]  # the CPU affinity the count was derived from (or checked against)
    interop: int = INTEROP_THREADS

    @property
    def total(self) -> int:
        return self.per_rank * self.tp_size

    def describe(self) -> str:
        why = "--cpu-threads" if self.source is ThreadSource.FLAG else f"{len(self.cores)} cores of the CPU affinity"
        return (
            f"cpu threads: {self.per_rank} intra-op per TP rank x {self.tp_size} rank(s) from {why}, "
            f"{self.interop} inter-op; affinity {format_cores(self.cores)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_rank": self.per_rank,
            "tp_size": self.tp_size,
            "total": self.total,
            "interop": self.interop,
            "source": self.source.value,
            "affinity": list(self.cores),
        }


def plan_cpu_threads(cpu_threads: int | None, tp_size: int, cores: Sequence[int]) -> CpuThreads:
    """`cpu_threads` (None: one per core in `cores`) split among `tp_size` ranks, at least 1 each."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"cpu threads must be >= 1, got {cpu_threads}")
    source = ThreadSource.AFFINITY if cpu_threads is None else ThreadSource.FLAG
    n = len(cores) if cpu_threads is None else cpu_threads
    return CpuThreads(max(1, n // tp_size), tp_size, source, tuple(sorted(cores)))


def server_cpu_threads(cfg: ServerConfig) -> CpuThreads:
    """The plan of a server with this config, on the cores this process may run on now."""
    return plan_cpu_threads(cfg.cpu_threads, cfg.tp_size, affinity_cores())


def affinity_cores() -> tuple[int, ...]:
    """The cores this process may run on (fewer than os.cpu_count() under taskset or a cgroup cpuset)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return tuple(range(os.cpu_count() or 1))


def format_cores(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5' (taskset's list form)."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive cores
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def apply_cpu_threads(plan: CpuThreads) -> None:
    """Set this process's torch intra-op (and, while still allowed, inter-op) thread counts.
    Call before the model loads; a TP rank's process calls it for itself."""
    import torch  # lazy: the server's routes read plans without importing torch

    torch.set_num_threads(plan.per_rank)
    if torch.get_num_interop_threads() != plan.interop:
        try:
            torch.set_num_interop_threads(plan.interop)
        except RuntimeError:  # inter-op work already ran in this process: torch keeps its pool
            pass


def torch_threads() -> dict[str, int]:
    """The counts torch reports in this process now (what /server_info shows next to the plan)."""
    import torch

    return {"intra_op": torch.get_num_threads(), "interop": torch.get_num_interop_threads()}


# libgomp (torch's OpenMP) spins a thread that waits at a barrier before it sleeps. On cores
# something else also wants (a PD stack beside it, a benchmark client, other work), the spinning
# thread takes the core from the one it waits for: a 2-thread server on 2 loaded cores used 4.6x
# the CPU and took 7x the wall time per request of the same server with PASSIVE (measured,
# docs/benchmarks.md); with the cores to itself PASSIVE costs a futex wake per parallel region.
OMP_WAIT_ENV = "OMP_WAIT_POLICY"
SERVER_OMP_WAIT_POLICY = "PASSIVE"


def prefer_passive_omp_wait(environ: MutableMapping[str, str]) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` unless the user chose a policy; returns the policy
    in effect. libgomp reads it once, when torch loads it: call before torch is imported (its TP
    workers inherit the environment)."""
    return environ.setdefault(OMP_WAIT_ENV, SERVER_OMP_WAIT_POLICY)
