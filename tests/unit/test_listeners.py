"""A server's listener table (kvpipe/server/listeners.py) without a server: /proc/net/tcp parsed,
ports named from a PD connector's stats, and this process's own listening socket found."""

from __future__ import annotations

import os
import socket

from kvpipe.server.listeners import Listener, listeners, listening_inodes, port_names, port_table, process_tree

# two LISTEN sockets (127.0.0.1:8000, 0.0.0.0:16988) and an established one, as the kernel writes them
TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0 100 0 0 10 0
   1: 00000000:423C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1002 1 0 100 0 0 10 0
   2: 0100007F:1F40 0100007F:D3A2 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0 20 4 30 10 -1
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000000000000:3D6D 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0 100 0 0 10 0
   1: 00000000000000000000000001000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2002 1 0 100 0 0 10 0
"""  # noqa: E501


def test_proc_net_tcp_is_parsed() -> None:
    assert listening_inodes(TCP) == {1001: ("127.0.0.1", 8000), 1002: ("0.0.0.0", 16956)}
    assert listening_inodes(TCP6) == {2001: ("::", 15725), 2002: ("::1", 8001)}


def test_ports_are_named_from_the_connector_s_stats() -> None:
    disagg = {
        "bootstrap_port": 8998,
        "rank_addresses": [
            {"rank": 0, "data": "127.0.0.1:16988", "control": "tcp://127.0.0.1:41575", "staging": None},
            {"rank": 1, "data": "[::1]:16990", "control": None, "staging": "tcp://127.0.0.1:41600"},
        ],
    }
    names = port_names(8000, disagg)
    found = [
        Listener(1, "127.0.0.1", 8000),
        Listener(1, "127.0.0.1", 8998),
        Listener(1, "127.0.0.1", 41575),
        Listener(1, "0.0.0.0", 16988),
        Listener(1, "::", 15725),
        Listener(2, "0.0.0.0", 16990),
        Listener(2, "127.0.0.1", 41600),
        Listener(2, "127.0.0.1", 5555),
    ]
    rows = {(r["port"], r["name"], r["rank"]) for r in port_table(found, names)}
    assert rows == {
        (8000, "http", None),
        (8998, "bootstrap", None),
        (41575, "control", 0),
        (16988, "mooncake_handshake", 0),
        (15725, "mooncake_data", None),  # unnamed, on every interface: an engine's data port
        (16990, "mooncake_handshake", 1),
        (41600, "staging", 1),
        (5555, "other", None),
    }
    assert port_names(8000, {}) == {8000: ("http", None)}  # colocated


def test_this_process_s_listener_is_found() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert Listener(os.getpid(), "127.0.0.1", port) in listeners(process_tree(os.getpid()))
    assert all(lst.port != port for lst in listeners([os.getpid()]))  # closed: gone
