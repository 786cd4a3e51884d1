"""The Mooncake Store master of a `kvpipe launch` stack whose servers use the KV tier
(--enable-hierarchical-cache --hicache-storage-backend mooncake without --hicache-mooncake-master):
`mooncake_master` (in the venv, from the Mooncake wheel) with its HTTP metadata server, every
listener on the stack's host and on free ports, supervised like the other parts (a restarted
master holds nothing: the servers compute and store again; cache/store_tier.py)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpipe.config import ConfigError, PortRange
from kvpipe.launch.core_split import has_flag
from kvpipe.listen_ports import Listener, Peer

TIER_FLAG = "--enable-hierarchical-cache"
MASTER_FLAG = "--hicache-mooncake-master"


def wants_master(server_args: Sequence[str]) -> bool:
    """The servers use the KV tier and nobody named a master: the stack starts one."""
    return has_flag(server_args, TIER_FLAG) and not has_flag(server_args, MASTER_FLAG)


def master_binary() -> str:
    """mooncake_master next to our Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.is_file() else shutil.which("mooncake_master")
    if found is None:
        raise ConfigError(
            "--enable-hierarchical-cache: no mooncake_master in the venv or on PATH (pip install mooncake)"
        )
    return found


@dataclass(frozen=True)
class StoreMaster:
    host: str
    rpc_port: int
    metadata_port: int
    http_port: int  # its metrics/admin server: GET /health

    def command(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.http_port}",
        ]

    @classmethod
    def from_command(cls, argv: Sequence[str]) -> StoreMaster:
        """The master a `mooncake_master` command line starts (the flags `command` writes)."""
        flags = dict(a.lstrip("-").split("=", 1) for a in argv if a.startswith("--") and "=" in a)
        try:
            return cls(
                flags["rpc_address"],
                int(flags["rpc_port"]),
                int(flags["http_metadata_server_port"]),
                int(flags["metrics_port"]),
            )
        except (KeyError, ValueError) as e:
            raise ConfigError(f"not a mooncake_master command line with every port: {list(argv)} ({e})") from None

    def listeners(self) -> tuple[Listener, ...]:
        """Its RPC and metadata ports (the servers' store clients) and its metrics (Prometheus)."""
        return (
            Listener("rpc", PortRange(self.rpc_port, self.rpc_port), (Peer.PD,)),
            Listener("metadata", PortRange(self.metadata_port, self.metadata_port), (Peer.PD,)),
            Listener("metrics", PortRange(self.http_port, self.http_port), (Peer.PROMETHEUS,)),
        )

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/health"

    def server_flags(self) -> list[str]:
        """What every server of the stack gets to reach it."""
        return [
            MASTER_FLAG,
            f"{self.host}:{self.rpc_port}",
            "--hicache-mooncake-metadata-server",
            f"http://{self.host}:{self.metadata_port}/metadata",
        ]
