"""The store the KV tier (cache/store_tier.py) talks to: an interface and its Mooncake Store client.

`MooncakeStoreClient` wraps `mooncake.store.MooncakeDistributedStore` (the wheel kvpipe installs for
its transfer engine also ships the distributed store and `mooncake_master`). Each client mounts a
segment of its own memory into the store's global pool (`global_segment_bytes`) and talks to the
master over RPC; the master places and evicts objects (its leases decide what stays). Measured
here: put, get and batch_is_exist return error codes at once (-900, RPC failure) while the master
is down, and the client reconnects by itself once a master answers on the same address again.

Every call here may block (network) and raises StoreError on a failure: the tier calls them from
its own threads only, never from the engine's step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """A store call failed (down, full, or refused); the tier falls back to computing."""


class KVStore(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, keys: Sequence[str]) -> list[bytes]:
        """Each key's value (b"" when missing)."""
        ...

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MooncakeStoreSpec:
    """How to reach a Mooncake Store (SGLang's MOONCAKE_* settings)."""

    master: str  # host:port of mooncake_master's RPC
    metadata_server: str  # "P2PHANDSHAKE" or the HTTP metadata server's URL (http://host:port/metadata)
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = 256 << 20  # what this client contributes to the store's pool
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    device: str = ""


class MooncakeStoreClient:
    def __init__(self, spec: MooncakeStoreSpec) -> None:
        from mooncake.store import MooncakeDistributedStore  # optional wheel: only with the tier on

        # Mooncake's TCP transport binds its listener to the address it picks (eth0 here, even
        # with a loopback local host): keep it where we were told to be
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", spec.local_hostname)
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(
            spec.local_hostname,
            spec.metadata_server,
            spec.global_segment_bytes,
            spec.local_buffer_bytes,
            spec.protocol,
            spec.device,
            spec.master,
        )
        if rc != 0:
            raise StoreError(f"Mooncake Store setup with master {spec.master} failed ({rc})")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            raise StoreError(f"batch_is_exist failed ({min(codes)})")
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str]) -> list[bytes]:
        return list(self._store.get_batch(list(keys)))

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        rc = self._store.put_batch(list(keys), list(values))
        if rc != 0:
            raise StoreError(f"put_batch of {len(keys)} pages failed ({rc})")

    def close(self) -> None:
        try:
            self._store.close()
        except Exception as e:  # closing a client whose master is gone: nothing left to do
            logger.debug("closing the Mooncake Store client: %s", e)
