"""A prefill's bootstrap server (one rank registered) in its own process, so a test can attack it
with many sockets and count the server's open descriptors in /proc without counting its own.

    python -m tests.helpers.bootstrap_victim MAX_CONNECTIONS READ_S
    -> {"port", "pid"}           # one JSON line once it serves
    (stdin closed)               # it stops"""

from __future__ import annotations

import json
import os
import sys

from kvpipe.config import ListenerLimits
from kvpipe.transfer.control.bootstrap import BootstrapServer, register_prefill_rank
from tests.helpers.bootstrap_info import rank_info


def main() -> None:
    read_s = float(sys.argv[2])  # the head's deadline, and the body's
    limits = ListenerLimits(max_connections=int(sys.argv[1]), header_timeout_s=read_s, body_timeout_s=read_s)
    with BootstrapServer("127.0.0.1", 0, limits=limits) as server:
        register_prefill_rank("127.0.0.1", server.port, rank_info(0))
        print(json.dumps({"port": server.port, "pid": os.getpid()}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
