"""A PD stack across the testbed's link: the prefill on side a, the decode and sglang-router on side
b, so every KV byte and control frame between them crosses the shaped (and faultable) veth pair.

    with LinkTestbed("8mbit") as tb, inside_netns(tb.ns_b):
        with start_testbed_stack(tb, model_path, server_args=[...]) as stack:
            ...  # stack.router_url etc. are reachable from this thread (and threads it starts)

It is a `launch.PDStack` like `kvpipe launch`'s (same parts, names and supervision: a part's spec
starts it again inside its namespace), built here because its parts live in two namespaces. The
caller's thread must be on side b (`testbed.inside_netns`) to reach the servers: the prefill answers
there across the link, the decode and router locally. The servers get the stack's PD token in their
environment (their data plane is off loopback) and disjoint shares of our cores, as `kvpipe launch`
gives them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvpipe.engine.cpu_threads import affinity_cores
from kvpipe.harness.testbed import LinkTestbed, tool
from kvpipe.launch.core_split import server_cores, split_cores
from kvpipe.launch.ports import free_ports
from kvpipe.launch.process import wait_healthy
from kvpipe.launch.router import router_command
from kvpipe.launch.secret_flags import split_secrets
from kvpipe.launch.stack import PartSpec, PDStack


def start_testbed_stack(
    tb: LinkTestbed,
    model_path: str | None,
    *,
    server_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    log_dir: str | None = None,
    timeout_s: float = 300.0,
) -> PDStack:
    """Start prefill (side a), decode and router (side b), each waited for until healthy (from the
    calling thread: it must be inside side b); everything started is stopped if one fails."""
    args, secrets = split_secrets(server_args, prefill_args, decode_args)
    p_port, b_port = tb.call_in("a", free_ports, 2, tb.addr_a)
    d_port, r_port, m_port = tb.call_in("b", free_ports, 3, tb.addr_b)
    p_url, d_url, r_url = (
        f"http://{h}:{p}" for h, p in ((tb.addr_a, p_port), (tb.addr_b, d_port), (tb.addr_b, r_port))
    )
    p_cores, d_cores = server_cores(split_cores(affinity_cores()), args.server, args.prefill, args.decode)
    model = ("--model-path", model_path) if model_path else ()

    def serve(side: str, host: str, port: int, *flags: str) -> tuple[str, ...]:
        cmd = (sys.executable, "-m", "kvpipe.cli", "serve", "--host", host, "--port", str(port), *model)
        return (tool("ip"), "netns", "exec", tb.spec.ns(side), *cmd, *args.server, *flags)  # type: ignore[arg-type]

    def log(name: str) -> str | None:
        if not log_dir:
            return None
        os.makedirs(log_dir, exist_ok=True)
        return os.path.join(log_dir, f"{name}.log")

    prefill = serve(
        "a",
        tb.addr_a,
        p_port,
        *p_cores.flags,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(b_port),
        *args.prefill,
    )
    decode = serve("b", tb.addr_b, d_port, *d_cores.flags, "--disaggregation-mode", "decode", *args.decode)
    router = (
        tool("ip"),
        "netns",
        "exec",
        tb.ns_b,
        *router_command(p_url, b_port, d_url, tb.addr_b, r_port, m_port),
    )
    stack = PDStack(p_url, d_url, r_url, b_port, None)
    stack.auth_token = secrets.token
    stack.router_metrics_url = f"http://{tb.addr_b}:{m_port}"
    stack.specs = [
        PartSpec("prefill", prefill, p_url + "/health", log("prefill"), p_cores.pin, secrets.env()),
        PartSpec("decode", decode, d_url + "/health", log("decode"), d_cores.pin, secrets.env()),
        PartSpec("router", router, r_url + "/health", log("router"), env=secrets.router_env()),
    ]
    try:
        for spec in stack.specs[:2]:
            stack.procs.append(spec.spawn())
        for spec in stack.specs[:2]:
            wait_healthy(spec.health_url, timeout_s, stack.procs)
        stack.procs.append(stack.specs[2].spawn())  # the router once the servers answer
        wait_healthy(r_url + "/health", timeout_s, stack.procs)
    except BaseException:
        stack.close()
        raise
    return stack
