"""xPyD launch bookkeeping without processes: how the cores split among N prefills and M decodes,
the router's command line, the server names and the flags --prefill-tp / --decode-tp become."""

from __future__ import annotations

import argparse

import pytest

from kvpipe.commands.launch import add_args, xpyd_server_args
from kvpipe.launch.core_split import split_cores, split_cores_among, stack_server_cores
from kvpipe.launch.router import router_command_xpyd
from kvpipe.launch.stack import PartSpec, PDStack, server_names


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9])
def test_one_prefill_one_decode_split_as_before(n: int) -> None:
    s, old = split_cores_among(range(n), 1, 1), split_cores(range(n))
    assert s.shares == (old.prefill, old.decode) and s.disjoint == old.disjoint


def test_cores_split_among_four_servers() -> None:
    s = split_cores_among(range(10), 2, 2)  # 10 // 4 = 2 each, the 2 left over to the prefills
    assert s.shares == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9)) and s.disjoint
    shared = split_cores_among([0, 1], 2, 2)  # fewer cores than servers: shared, nobody pinned
    assert shared.shares == ((0,), (1,), (0,), (1,)) and not shared.disjoint
    cores = stack_server_cores(shared, [], [[], [], [], []])
    assert all(c.flags == ("--cpu-threads", "1") and c.pin is None for c in cores)
    pinned = stack_server_cores(s, [], [["--cpu-threads", "4"], [], [], []])
    assert pinned[0].flags == () and pinned[1].pin == (3, 4, 5)
    with pytest.raises(ValueError):
        split_cores_among([0], 0, 1)


def test_router_command_lists_every_worker_and_the_policies() -> None:
    cmd = router_command_xpyd(
        [("http://p0", 11), ("http://p1", 12)],
        ["http://d0", "http://d1"],
        "h",
        1,
        2,
        prefill_policy="cache_aware",
        decode_policy="round_robin",
    )
    line = " ".join(cmd)
    assert "--prefill http://p0 11 --prefill http://p1 12 --decode http://d0 --decode http://d1" in line
    assert "--prefill-policy cache_aware" in line and "--decode-policy round_robin" in line
    assert "policy" not in " ".join(router_command_xpyd([("http://p", 1)], ["http://d"], "h", 1, 2))


def test_names_and_layout() -> None:
    assert server_names(1, 1) == ["prefill", "decode"]
    assert server_names(2, 1) == ["prefill0", "prefill1", "decode0"]
    specs = [
        PartSpec("prefill0", ("serve", "--tp-size", "2"), "http://p0/health"),
        PartSpec("prefill1", ("serve", "--tp-size", "2"), "http://p1/health"),
        PartSpec("decode0", ("serve",), "http://d0/health"),
        PartSpec("router", ("router",), "http://r/health"),
    ]
    stack = PDStack("http://p0", "http://d0", "http://r", 11, specs=specs)
    stack.prefill_urls, stack.decode_urls, stack.bootstrap_ports = ["http://p0", "http://p1"], ["http://d0"], [11, 12]
    stack.cores = split_cores_among([0, 1, 2], 2, 1)
    lines = stack.layout_lines()
    assert lines[0] == "layout: 2P1D"
    assert lines[2].split() == ["prefill1", "http://p1", "(bootstrap", "port", "12,", "TP", "2,", "cores", "1)"]
    assert lines[3].split() == ["decode0", "http://d0", "(TP", "1,", "cores", "2)"]
    assert lines[4].startswith("  router    http://r")
    assert stack.metrics_urls == {"prefill0": "http://p0", "prefill1": "http://p1", "decode0": "http://d0"}


def test_tp_flags() -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--prefills", "2", "--decodes", "3", "--prefill-tp", "2", "--decode-policy", "round_robin"])
    assert (args.prefills, args.decodes, args.decode_policy, args.prefill_policy) == (2, 3, "round_robin", None)
    assert xpyd_server_args(args) == (["--tp-size", "2"], [])
    with pytest.raises(SystemExit):
        xpyd_server_args(p.parse_args(["--decodes", "0"]))
