"""What `kvpipe launch` prints once its stack is up: the server flags it forwarded, how the servers
share the cores, where the PD token and the HTTP API's keys came from (never the secrets), the
firewall, and the ready banner with every worker."""

from __future__ import annotations

import os

from kvpipe.launch.core_split import CPU_THREADS_FLAG, StackCores, has_flag
from kvpipe.launch.secret_flags import API_KEY_FLAG, AUTH_TOKEN_FILE_FLAG, AUTH_TOKEN_FLAG
from kvpipe.launch.stack import PDStack
from kvpipe.launch.supervisor import RestartPolicy
from kvpipe.transfer.control.auth import TOKEN_ENV

# flags whose value is a secret: echoed as *** (the servers get them in their environment)
SECRET_VALUE_FLAGS = (API_KEY_FLAG, "--admin-api-key", AUTH_TOKEN_FLAG)


def shown_args(args: list[str]) -> str:
    """Command-line args as a line with the secrets' values replaced by ***."""
    out: list[str] = []
    hide_next = False
    for a in args:
        flag, eq, _ = a.partition("=")
        if hide_next:
            out.append("***")
            hide_next = False
        elif flag in SECRET_VALUE_FLAGS:
            out.append(f"{flag}=***" if eq else a)
            hide_next = not eq
        else:
            out.append(a)
    return " ".join(out)


def forwarded_lines(extra: list[str], defaults: list[str], role_args: dict[str, list[str]]) -> list[str]:
    """The server flags of the stack: the user's (every server), launch's own defaults, each role's."""
    given = shown_args(extra) if extra else "none"
    lines = [f"server flags forwarded to every server: {given}"]
    if defaults:
        lines.append(f"launch's defaults for every server (a flag given overrides): {' '.join(defaults)}")
    lines += [f"{role} servers also get: {' '.join(args)}" for role, args in role_args.items() if args]
    return lines


def cores_lines(stack: PDStack, extra: list[str]) -> list[str]:
    """How the servers share the cores (each server's own cores are on its layout line)."""
    if has_flag(extra, CPU_THREADS_FLAG):
        return ["every server takes the given --cpu-threads (no core split)"]
    if isinstance(stack.cores, StackCores):
        how = "each server pinned to its share" if stack.cores.disjoint else "fewer cores than servers: one thread each"
        return [f"cores split among {len(stack.cores.shares)} servers; {how}"]
    if stack.cores is not None:
        how = "each server pinned to its share" if stack.cores.disjoint else "one thread each"
        return [f"{stack.cores.describe()}; --cpu-threads its size, {how}"]
    return []


def auth_lines(stack: PDStack, extra: list[str]) -> list[str]:
    """Where the PD control plane's token came from."""
    if not stack.auth_token and not has_flag(extra, AUTH_TOKEN_FILE_FLAG):
        return []
    if has_flag(extra, AUTH_TOKEN_FLAG):
        chosen = f"the {AUTH_TOKEN_FLAG} given (passed to the servers in their environment)"
    elif not stack.auth_token:
        chosen = f"the token in {AUTH_TOKEN_FILE_FLAG}"
    else:
        chosen = "$" + TOKEN_ENV if os.environ.get(TOKEN_ENV) else "a fresh random token"
    return [f"PD bootstrap and control plane authenticated with {chosen}"]


def keys_lines(stack: PDStack) -> list[str]:
    """Where the HTTP API's keys are (never the keys: this output ends up in logs and scrollback)."""
    if stack.keys_file is None:
        return ["HTTP API open: no API keys (--no-api-keys); anyone who reaches a port may use every route"]
    fresh = {(): "the keys given", ("user",): "a fresh user key", ("admin",): "a fresh admin key"}
    what = fresh.get(stack.generated_keys, "fresh random user and admin keys")
    return [
        f"HTTP API keys: {what}, in {stack.keys_file} (mode 0600, removed at stop); "
        f"`. {stack.keys_file}` exports KVPIPE_API_KEY (requests), KVPIPE_ADMIN_API_KEY (the router's "
        "control plane, the servers' admin routes) and OPENAI_API_KEY; kvpipe chat, top and bench find them there"
    ]


def firewall_lines(stack: PDStack) -> list[str]:
    fw = stack.firewall
    if fw is None or fw.applied is None:
        return []
    ports = ", ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in fw.applied.ports)
    allow = f" and {', '.join(fw.allow)}" if fw.allow else ""
    return [f"firewall ({fw.kind} {fw.name}): ports {ports} accept connections only from this host{allow}"]


def ready_banner(stack: PDStack, policy: RestartPolicy) -> str:
    """The ready line with every worker, a request to try, and what supervision does."""
    source = f". {stack.keys_file} && " if stack.keys_file else ""
    bearer = '-H "Authorization: Bearer $KVPIPE_API_KEY" ' if stack.keys_file else ""
    workers = ", ".join(
        f"{name} {url}" + (f" bootstrap port {port}" if port is not None else "") for name, url, port in stack.workers()
    )
    return (
        f"kvpipe PD stack ready: router {stack.router_url} ({workers})\n"
        f"try: {source}curl -s {stack.router_url}/v1/chat/completions {bearer}-H 'Content-Type: application/json' "
        f'-d \'{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}], '
        f'"max_tokens": 32, "temperature": 0}}\'\n'
        f"A part that exits is restarted (at most {policy.max_restarts} times in {policy.window_s:g} s). "
        "Ctrl-C stops everything."
    )
