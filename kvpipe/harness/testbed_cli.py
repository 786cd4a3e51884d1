"""`kvpipe testbed up --rate RATE` / `down` / `status`: the link testbed from the shell.

`up` creates a persistent testbed, records it in a state file under the temp dir and prints how to
start processes on each side. `down` removes testbeds made by `up`, and the leftovers of runs whose
owner process died (a SIGKILLed benchmark); it never touches a live run's testbed unless named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from kvpipe.harness.testbed import (
    DEFAULT_MTU,
    LinkSpec,
    LinkTestbed,
    LinkTestbedError,
    check_privileges,
    default_state_dir,
    namespace_exists,
    remove_testbed,
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recorded(where: Path | None = None) -> list[tuple[Path, dict]]:
    """(state file, its JSON) for every testbed recorded under `where` (default: default_state_dir())."""
    where = where or default_state_dir()
    out = []
    for path in sorted(where.glob("*.json")) if where.is_dir() else []:
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda x: x[1].get("created", 0))


def removable(state: dict, name: str | None) -> bool:
    """Which recorded testbeds `down` removes: the named one, else persistent or orphaned ones."""
    if name is not None:
        return state["spec"]["name"] == name
    return bool(state.get("persistent")) or not _pid_alive(int(state.get("owner_pid", 0)))


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="testbed_cmd", metavar="{up,down,status}", required=True)
    up = sub.add_parser("up", help="create two namespaces joined by a shaped veth pair")
    up.add_argument("--rate", required=True, help="link rate in tc units, e.g. 500mbit, 2gbit")
    up.add_argument("--burst-bytes", type=int, default=None, help="tbf burst (default: 1 ms at line rate)")
    up.add_argument("--latency-ms", type=int, default=50, help="tbf queue latency bound")
    up.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="veth MTU of both ends (9000: jumbo frames)")
    up.add_argument("--json", action="store_true", help="print the state as one JSON object")
    down = sub.add_parser("down", help="remove testbeds made by `up` (and orphaned ones)")
    down.add_argument("--name", default=None, help="remove only this testbed (from `up` or `status`)")
    sub.add_parser("status", help="list recorded testbeds")


def _describe(spec: LinkSpec) -> str:
    return (
        f"testbed {spec.name}: {spec.rate} ({spec.rate_bps / 1e9:.3g} Gbit/s) tbf burst "
        f"{spec.burst_bytes} B latency {spec.latency_ms} ms mtu {spec.mtu}\n"
        f"  side a: netns {spec.ns_a}  {spec.addr_a}  (e.g. the prefill)\n"
        f"  side b: netns {spec.ns_b}  {spec.addr_b}  (e.g. decode and router)\n"
        f"  run:    ip netns exec {spec.ns_a} kvpipe serve --host {spec.addr_a} ...\n"
        f"  remove: kvpipe testbed down --name {spec.name}"
    )


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    try:
        if args.testbed_cmd == "up":
            tb = LinkTestbed(
                args.rate, burst_bytes=args.burst_bytes, latency_ms=args.latency_ms, mtu=args.mtu, persistent=True
            ).up()
            print(
                json.dumps({"state_file": str(tb.state_path), **asdict(tb.spec), "ns_a": tb.ns_a, "ns_b": tb.ns_b})
                if args.json
                else _describe(tb.spec)
            )
            return 0
        if args.testbed_cmd == "status":
            for path, st in recorded():
                spec = LinkSpec(**st["spec"])
                alive = namespace_exists(spec.ns_a) or namespace_exists(spec.ns_b)
                print(
                    f"{spec.name}  rate {spec.rate}  owner {st.get('owner_pid')}  "
                    f"{'persistent' if st.get('persistent') else 'run-scoped'}  "
                    f"{'up' if alive else 'gone'}  ({path})"
                )
            return 0
        check_privileges()
        todo = [(p, st) for p, st in recorded() if removable(st, args.name)]
        if args.name is not None and not todo:
            print(f"kvpipe testbed: no recorded testbed named {args.name!r}", file=sys.stderr)
            return 1
        for path, st in todo:
            spec = LinkSpec(**st["spec"])
            remove_testbed(spec)
            path.unlink(missing_ok=True)
            print(f"removed {spec.name} ({spec.ns_a}, {spec.ns_b})")
        return 0
    except (LinkTestbedError, ValueError) as e:
        print(f"kvpipe testbed: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe testbed", description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
