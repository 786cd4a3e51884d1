"""A mooncake_master (Mooncake Store's master with its HTTP metadata server) on free loopback ports
for the KV-tier tests: started, killed and restarted on the same ports, always cleaned up."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvpipe.launch.ports import free_ports
from kvpipe.launch.process import stop_process

MASTER = Path(sys.executable).parent / "mooncake_master"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Master:
    log_path: Path
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def server_flags(self, retry_s: float = 1.0) -> list[str]:
        """`kvpipe serve` flags of a server that uses this store as its KV tier."""
        return [
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-mooncake-master",
            self.address,
            "--hicache-mooncake-metadata-server",
            self.metadata_url,
            "--hicache-mooncake-global-segment-size",
            "32mb",
            "--hicache-mooncake-local-buffer-size",
            "16mb",
            "--hicache-store-retry-interval",
            str(retry_s),
            "--hicache-store-fetch-timeout",
            "10",  # a loaded test machine: a slow fetch would count as a fallback and fail the reuse checks
        ]

    def start(self, timeout_s: float = 30.0) -> None:
        if not self.rpc_port:
            self.rpc_port, self.metadata_port, self.metrics_port = free_ports(3)
        cmd = [
            str(MASTER),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--client_ttl=5",
        ]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not (_listening(self.rpc_port) and _listening(self.metadata_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=5.0)


@contextmanager
def running_master(log_dir: Path) -> Iterator[Master]:
    """A started master (its log in `log_dir`), stopped on the way out (a module fixture's body)."""
    m = Master(log_dir / "master.log")
    m.start()
    try:
        yield m
    finally:
        m.stop()
