"""The transfer backends by name: the one list the flags, the server checks, the server's start-up
(disagg/setup.py) and the conformance test (tests/unit/test_backend_conformance.py) read.

Each entry names its TransferBackend class as "module:Class", imported only when the backend is
made (`BackendSpec.load`), and says what the backend can do. A backend module imports its heavy
optional dependency only when it starts (Mooncake's wheel in `_new_engine`), so choosing the
local backend never touches it. Adding a backend: its module beside this one (a TransferBackend
with `name`, `from_options` and `sibling`) and one entry in BACKENDS (docs/architecture.md,
"Adding a transfer backend").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvpipe.config import ConfigError, DisaggregationConfig
from kvpipe.transfer.backends.base import BackendOptions, TransferBackend, TransferError


@dataclass(frozen=True)
class BackendSpec:
    name: str  # --disaggregation-transfer-backend's choice, and the class's `name`
    cls: str  # "module:Class" of its TransferBackend
    summary: str  # one line of --help
    crosses_processes: bool  # its peers may live in other processes (every PD server needs this)
    crosses_hosts: bool  # ... and on other machines (it listens on BackendOptions.host)
    rdma: bool  # it writes over RDMA when given BackendOptions.ib_device
    needs: str | None = None  # the optional module it imports when it starts; None: nothing beyond kvpipe's own
    extra: str | None = None  # kvpipe's pip extra that installs `needs`

    def load(self) -> type[TransferBackend]:
        """The backend's class (imports its module now)."""
        module, _, attr = self.cls.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, TransferBackend) and cls.name == self.name):
            raise TypeError(f"{self.cls} is not the TransferBackend named {self.name!r}")
        return cls

    def missing(self) -> str | None:
        """Why this backend cannot start here (its optional module does not import), or None."""
        if self.needs is None:
            return None
        try:
            importlib.import_module(self.needs)
        except ImportError as e:
            hint = f" (pip install 'kvpipe[{self.extra}]')" if self.extra else ""
            return f"the {self.name} transfer backend needs {self.needs}{hint}: {e}"
        return None


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        "mooncake",
        "kvpipe.transfer.backends.mooncake:MooncakeBackend",
        "the Mooncake Transfer Engine: TCP, or RDMA with --disaggregation-ib-device",
        crosses_processes=True,
        crosses_hosts=True,
        rdma=True,
        needs="mooncake.engine",
        extra="mooncake",
    ),
    BackendSpec(
        "local",
        "kvpipe.transfer.backends.local:LocalBackend",
        "in-process copies between engines of one process (tests only)",
        crosses_processes=False,
        crosses_hosts=False,
        rdma=False,
    ),
)


def backend_names() -> tuple[str, ...]:
    return tuple(s.name for s in BACKENDS)


def backend_spec(name: str) -> BackendSpec:
    """The registered backend called `name`; ConfigError listing the known ones otherwise."""
    for spec in BACKENDS:
        if spec.name == name:
            return spec
    raise ConfigError(f"unknown transfer backend {name!r}; known: {', '.join(backend_names())}")


def open_backend(name: str, options: BackendOptions) -> TransferBackend:
    """Start the backend called `name` as a server does (TransferError when it cannot start here)."""
    spec = backend_spec(name)
    why = spec.missing()
    if why is not None:
        raise TransferError(why)
    return spec.load().from_options(options)


def _able(what: str) -> str:
    return " or ".join(s.name for s in BACKENDS if getattr(s, what))


def check_backend(d: DisaggregationConfig, tp_size: int, *, own_process: bool = False) -> BackendSpec:
    """The chosen backend's spec; ConfigError naming the flags when it cannot serve this PD set-up.
    `own_process`: the server is a process of its own (`kvpipe serve`), so its peers are in others.
    Checked when a server is configured, not on the config's construction: tests drive TP ranks'
    transfer parts inside one process with the local backend."""
    spec = backend_spec(d.transfer_backend)
    if not d.enabled:
        return spec
    if tp_size > 1 and not spec.crosses_processes:
        raise ConfigError(
            f"--disaggregation-mode {d.mode} with --tp-size {tp_size} needs --disaggregation-transfer-backend "
            f"{_able('crosses_processes')}: TP ranks are separate processes and the {spec.name} backend only "
            "copies inside one process"
        )
    if d.ib_device and not spec.rdma:
        raise ConfigError(f"--disaggregation-ib-device needs --disaggregation-transfer-backend {_able('rdma')}")
    if own_process and not spec.crosses_processes:
        raise ConfigError(
            f"--disaggregation-transfer-backend {spec.name} only connects engines inside one process; "
            f"PD servers need {_able('crosses_processes')}"
        )
    return spec
