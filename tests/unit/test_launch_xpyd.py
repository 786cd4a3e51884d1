"""xPyD launch bookkeeping without processes: how the cores split among N prefills and M decodes,
the router's command line, the server names and the flags --prefill-tp / --decode-tp become, and
what `kvpipe launch` prints: the layout with each server's real cores, the forwarded flags, the
ready line, its --help."""

from __future__ import annotations

import argparse

import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.launch import add_args, xpyd_server_args
from kvpipe.commands.launch_report import forwarded_lines, ready_banner
from kvpipe.engine.cpu_threads import affinity_cores, format_cores
from kvpipe.launch.core_split import split_cores, split_cores_among, stack_server_cores
from kvpipe.launch.router import router_command_xpyd
from kvpipe.launch.stack import PartSpec, PDStack, server_names
from kvpipe.launch.supervisor import RestartPolicy


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


def _stack(specs: list[PartSpec], prefills: int) -> PDStack:
    urls = [s.health_url.removesuffix("/health") for s in specs if s.name != "router"]
    stack = PDStack(urls[0], urls[prefills], "http://r", 11, specs=specs)
    stack.prefill_urls, stack.decode_urls = urls[:prefills], urls[prefills:]
    stack.bootstrap_ports = [11 + i for i in range(prefills)]
    return stack


def test_names_and_layout() -> None:
    assert server_names(1, 1) == ["prefill", "decode"]
    assert server_names(2, 1) == ["prefill0", "prefill1", "decode0"]
    specs = [
        PartSpec("prefill0", ("serve", "--tp-size", "2", "--cpu-threads", "1"), "http://p0/health", pin=(0,)),
        PartSpec("prefill1", ("serve", "--tp-size", "2", "--cpu-threads", "1"), "http://p1/health", pin=(1,)),
        PartSpec("decode0", ("serve", "--cpu-threads", "1"), "http://d0/health", pin=(2,)),
        PartSpec("router", ("router",), "http://r/health"),
    ]
    stack = _stack(specs, 2)
    stack.cores = split_cores_among([0, 1, 2], 2, 1)
    lines = stack.layout_lines()
    assert lines[0] == "layout: 2P1D"
    # TP 2 with --cpu-threads 1: at least one thread per rank
    assert lines[2].split() == [
        *("prefill1", "http://p1", "(bootstrap", "port", "12,", "TP", "2,", "2", "threads,", "cores", "1"),
        "(pinned))",
    ]
    assert lines[3].split() == ["decode0", "http://d0", "(TP", "1,", "1", "thread,", "cores", "2", "(pinned))"]
    assert lines[4].startswith("  router    http://r")
    assert stack.metrics_urls == {"prefill0": "http://p0", "prefill1": "http://p1", "decode0": "http://d0"}


def test_2p2d_on_fewer_cores_shows_the_cores_each_server_really_has() -> None:
    """Four servers on two cores share them, one thread each, none pinned: each runs on the
    launcher's cores (issue 47: the layout said "cores 0" while every server had affinity 0-1)."""
    split = split_cores_among([0, 1], 2, 2)
    names = server_names(2, 2)
    specs = [
        PartSpec(n, ("serve", *c.flags), f"http://{n}/health", pin=c.pin)
        for n, c in zip(names, stack_server_cores(split, [], [[]] * 4))
    ]
    stack = _stack([*specs, PartSpec("router", ("router",), "http://r/health")], 2)
    stack.cores = split
    every = format_cores(affinity_cores())
    for name, line in zip(names, stack.layout_lines()[1:5]):
        assert line.split()[0] == name and line.endswith(f"TP 1, 1 thread, cores {every} (not pinned))"), line


def test_ready_banner_lists_every_worker() -> None:
    specs = [PartSpec(n, ("serve",), f"http://{n}:1/health") for n in server_names(2, 2)]
    stack = _stack([*specs, PartSpec("router", ("router",), "http://r/health")], 2)
    first = ready_banner(stack, RestartPolicy()).splitlines()[0]
    assert first == (
        "kvpipe PD stack ready: router http://r (prefill0 http://prefill0:1 bootstrap port 11, "
        "prefill1 http://prefill1:1 bootstrap port 12, decode0 http://decode0:1, decode1 http://decode1:1)"
    )


def test_forwarded_flags_are_echoed_without_secrets() -> None:
    extra = ["--page-size", "16", "--api-key", "sk-1", "--admin-api-key=adm", "--disaggregation-auth-token", "t"]
    lines = forwarded_lines(extra, ["--x", "1"], {"prefill": ["--tp-size", "2"], "decode": []})
    assert lines[0] == (
        "server flags forwarded to every server: --page-size 16 --api-key *** --admin-api-key=*** "
        "--disaggregation-auth-token ***"
    )
    assert lines[1].endswith(": --x 1") and lines[2] == "prefill servers also get: --tp-size 2" and len(lines) == 3
    assert forwarded_lines([], [], {})[0].endswith(": none")


def test_help_says_unknown_flags_go_to_every_server() -> None:
    parser, _ = build_parser(["launch"])
    launch = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["launch"]
    text = " ".join(launch.format_help().split())
    assert "Every flag not listed here is forwarded to every server" in text
    for flag in (
        *("--api-key", "--api-key-file", "--admin-api-key", "--admin-api-key-file", "--disaggregation-auth-token"),
        *("--page-size", "--kv-cache-dtype", "--speculative-algorithm", "--cpu-threads", "--no-api-keys"),
        *("--prefills", "--decodes", "--prefill-tp", "--decode-tp", "--prefill-policy", "--decode-policy"),
        *("--model-path", "--port", "--host", "--log-dir", "--max-restarts", "--prometheus-targets", "--firewall"),
    ):
        assert f"{flag} " in text, flag


def test_tp_flags() -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--prefills", "2", "--decodes", "3", "--prefill-tp", "2", "--decode-policy", "round_robin"])
    assert (args.prefills, args.decodes, args.decode_policy, args.prefill_policy) == (2, 3, "round_robin", None)
    assert xpyd_server_args(args) == (["--tp-size", "2"], [])
    with pytest.raises(SystemExit):
        xpyd_server_args(p.parse_args(["--decodes", "0"]))
