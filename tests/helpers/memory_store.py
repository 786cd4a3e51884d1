"""A KVStore (cache/store_client.py's interface) in this process's memory, for unit tests of the KV
tier's scheduling: the real store (Mooncake Store) cannot be made to answer at a chosen moment, this
one answers only once its gate is open, so a test fixes the order of a slow fetch and the steps
around it. Values are kept as given; `calls` counts each method's calls."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence


class MemoryStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.gate = threading.Event()  # calls wait until it is set (open from the start)
        self.gate.set()
        self.calls: Counter[str] = Counter()

    def _wait(self, what: str) -> None:
        self.calls[what] += 1
        if not self.gate.wait(60.0):
            raise TimeoutError("the test never opened the store's gate")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._wait("exists")
        return [k in self.data for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes]:
        self._wait("get")
        return [self.data.get(k, b"") for k in keys]

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        self._wait("put")
        self.data.update(zip(keys, (bytes(v) for v in values)))

    def close(self) -> None:
        pass
