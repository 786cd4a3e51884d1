"""Transfer backends by name (`create_backend`): `base.py` is the interface (TransferBackend, batch
handles and states), `local.py` the in-process backend, `mooncake.py` Mooncake's, whose module is
imported only when asked for (it imports the optional `mooncake` wheel at its top)."""

from __future__ import annotations

from typing import Any

from kvpipe.transfer.backends.base import BatchHandle, BatchState, TransferBackend, TransferError
from kvpipe.transfer.backends.local import LocalBackend

BACKENDS = ("mooncake", "local")


def create_backend(name: str, **kwargs: Any) -> TransferBackend:
    """`mooncake` kwargs: hostname, protocol ("tcp" | "rdma"), device, window, inject, ...;
    `local` kwargs: fabric, inject."""
    if name == "mooncake":
        from kvpipe.transfer.backends.mooncake import MooncakeBackend

        return MooncakeBackend(**kwargs)
    if name == "local":
        return LocalBackend(**kwargs)
    raise ValueError(f"unknown transfer backend {name!r}; choose from {BACKENDS}")


__all__ = [
    "BACKENDS",
    "BatchHandle",
    "BatchState",
    "TransferBackend",
    "TransferError",
    "create_backend",
]
