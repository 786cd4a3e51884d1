"""Transfer backends: `base.py` is the interface (TransferBackend, BackendOptions, batch handles and
states), `registry.py` the backends by name with what each can do (`open_backend`,
`check_backend`), one module per backend beside them (`local.py` in-process, `mooncake.py`
Mooncake's), each imported only when chosen."""

from __future__ import annotations

from kvpipe.transfer.backends.base import BackendOptions, BatchHandle, BatchState, TransferBackend, TransferError
from kvpipe.transfer.backends.registry import (
    BACKENDS,
    BackendSpec,
    backend_names,
    backend_spec,
    check_backend,
    open_backend,
)

__all__ = [
    "BACKENDS",
    "BackendOptions",
    "BackendSpec",
    "BatchHandle",
    "BatchState",
    "TransferBackend",
    "TransferError",
    "backend_names",
    "backend_spec",
    "check_backend",
    "open_backend",
]
