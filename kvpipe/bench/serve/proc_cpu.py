"""CPU time a process has used, from /proc/PID/stat (Linux): what an idle server burns.

`kvpipe bench serve --compare-colocated --interleave` keeps both stacks up and runs one while the
other waits, so an idle stack that spun (a busy-polling loop, OpenMP threads spinning between
forwards) would slow the measured one; this reads how much CPU a waiting server really takes.
"""

from __future__ import annotations

import os

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads together (not its
    children). Raises OSError where /proc has no such process."""
    with open(f"/proc/{pid}/stat") as f:
        # fields after the ")" that closes the command name: state is [0], utime [11], stime [12]
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
