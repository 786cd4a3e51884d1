"""Free ports for a stack's parts, picked all at once so that no two parts get the same one.

A port is free when picked, but the part binds it seconds later (after its model loads), and
another process on the machine may take it meanwhile: `ports_taken` tells such a loss from another
reason to exit, and `StackPorts.refresh` gives the part that lost one fresh ports.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: all bound at once (ports picked one by one and released can repeat;
    a router once got the prefill's port for its metrics)."""
    with contextlib.ExitStack() as es:
        socks = [es.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def ports_taken(host: str, ports: Sequence[int]) -> bool:
    """Whether another process holds one of `ports` (bind fails; SO_REUSEADDR so that our own
    closed sockets in TIME_WAIT do not count)."""
    return any(bind_error(host, port) is not None for port in ports)


def bind_error(host: str, port: int) -> str | None:
    """Why `port` on `host` cannot be bound now ("Address already in use", an address not on this
    machine), or None when it can (SO_REUSEADDR, as in ports_taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


@dataclass
class StackPorts:
    """The ports of a stack's parts. Part i < len(http) is a server on http[i] (a prefill, i <
    prefills, also on bootstrap[i]); part len(http) is the router, on `router` with its Prometheus
    exporter on `metrics`."""

    host: str
    prefills: int
    http: list[int]
    bootstrap: list[int]
    router: int
    metrics: int
    router_given: bool  # the caller chose the router's port: theirs to keep, never replaced

    @classmethod
    def pick(
        cls, host: str, prefills: int, decodes: int, router_port: int | None, extra: int = 0
    ) -> tuple[StackPorts, list[int]]:
        """Ports for every part, and `extra` more for others (the KV tier's store), all distinct."""
        n = prefills + decodes
        ports = free_ports(n + prefills + 2 + extra, host)  # all at once: distinct
        others = ports[len(ports) - extra :]
        ports = ports[: len(ports) - extra]
        http, bootstrap, (r_free, metrics) = ports[:n], ports[n : n + prefills], ports[-2:]
        return cls(host, prefills, http, bootstrap, router_port or r_free, metrics, bool(router_port)), others

    @property
    def router_part(self) -> int:
        return len(self.http)

    def picked(self, i: int) -> list[int]:
        """The ports we picked for part i (a caller's router port is not ours)."""
        if i == self.router_part:
            return [self.metrics, *([] if self.router_given else [self.router])]
        return [self.http[i], *([self.bootstrap[i]] if i < self.prefills else [])]

    def refresh(self, i: int) -> None:
        """Fresh ports for part i, which lost one of its picked ports to another process."""
        if i == self.router_part:
            fresh = free_ports(2, self.host)
            self.router, self.metrics = self.router if self.router_given else fresh[0], fresh[1]
        elif i < self.prefills:
            self.http[i], self.bootstrap[i] = free_ports(2, self.host)
        else:
            self.http[i] = free_ports(1, self.host)[0]
