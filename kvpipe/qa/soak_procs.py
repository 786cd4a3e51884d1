"""Resource readings of a server's process group from /proc (Linux): RSS, open fds, threads.

A server started with `start_new_session` leads its own process group, and its TP rank workers
(spawned children) stay in it, so the group is the server. Processes that vanish while we read
are skipped (a reading is a snapshot, not a transaction).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcSample:
    """One server's process group at one time: summed over its processes (TP ranks included)."""

    t_s: float  # seconds since the soak started
    rss_kb: int
    fds: int
    threads: int
    procs: int

    def as_row(self) -> list[float]:
        return [round(self.t_s, 2), round(self.rss_kb / 1024, 1), self.fds, self.threads, self.procs]


def _pgid(pid_dir: Path) -> int | None:
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[2]) if len(fields) > 2 else None  # state, ppid, pgrp


def group_pids(pgid: int, proc: Path = PROC) -> list[int]:
    """Every live process of process group `pgid`."""
    out = []
    for d in proc.iterdir():
        if d.name.isdigit() and _pgid(d) == pgid:
            out.append(int(d.name))
    return sorted(out)


def _status_fields(pid_dir: Path) -> tuple[int, int] | None:
    """(VmRSS in kB, Threads) from /proc/PID/status."""
    rss = threads = None
    try:
        for line in (pid_dir / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    except OSError:
        return None
    return (rss or 0, threads or 0) if threads is not None else None


def sample_group(pgid: int, t_s: float, proc: Path = PROC) -> ProcSample | None:
    """The summed reading of group `pgid`; None when none of its processes is left."""
    rss = fds = threads = procs = 0
    for pid in group_pids(pgid, proc):
        d = proc / str(pid)
        st = _status_fields(d)
        try:
            n_fds = len(os.listdir(d / "fd"))
        except OSError:
            continue
        if st is None:
            continue
        rss, threads, fds, procs = rss + st[0], threads + st[1], fds + n_fds, procs + 1
    return ProcSample(t_s, rss, fds, threads, procs) if procs else None
