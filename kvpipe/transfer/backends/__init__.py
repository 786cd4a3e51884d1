"""Transfer backends by name, imported lazily (Mooncake is an optional dependency)."""

from __future__ import annotations

from typing import Any

from kvpipe.transfer.backends.base import BatchHandle, BatchState, FailureInjection, TransferBackend, TransferError

BACKENDS = ("mooncake", "local")


def create_backend(name: str, **kwargs: Any) -> TransferBackend:
    """`mooncake` kwargs: hostname, protocol ("tcp" | "rdma"), device, window, inject, ...;
    `local` kwargs: fabric, inject."""
    if name == "mooncake":
        from kvpipe.transfer.backends.mooncake import MooncakeBackend

        return MooncakeBackend(**kwargs)
    if name == "local":
        from kvpipe.transfer.backends.local import LocalBackend

        return LocalBackend(**kwargs)
    raise ValueError(f"unknown transfer backend {name!r}; choose from {BACKENDS}")


__all__ = [
    "BACKENDS",
    "BatchHandle",
    "BatchState",
    "FailureInjection",
    "TransferBackend",
    "TransferError",
    "create_backend",
]
