"""The KV connector of a server's disaggregation mode: what `kvpipe serve` hands its engine."""

from __future__ import annotations

from kvpipe.config import ServerConfig
from kvpipe.disagg.decode import DecodeConnector
from kvpipe.disagg.prefill import PrefillConnector
from kvpipe.engine.connector import KVConnector
from kvpipe.transfer.backends.base import TransferBackend


def make_connector(cfg: ServerConfig, backend: TransferBackend | None = None) -> KVConnector | None:
    """The connector of `cfg`'s disaggregation mode (None: a colocated server)."""
    mode = cfg.disaggregation.mode
    if mode == "prefill":
        return PrefillConnector(cfg, backend)
    if mode == "decode":
        return DecodeConnector(cfg, backend)
    return None
