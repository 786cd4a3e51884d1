"""What a report says about the machine it ran on: the CPU, the cores we may use, the load average
(other work on a shared machine shows there)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from kvpipe.engine.cpu_threads import affinity_cores


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_info(load_before: float | None) -> dict[str, Any]:
    """The CPU, the cores we may use, and the 1-minute load average before our servers started."""
    return {"cpu": cpu_name(), "cores": len(affinity_cores()), "load_avg_1m_before": load_before}
