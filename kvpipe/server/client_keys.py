"""The HTTP API keys kvpipe's own clients send (`kvpipe chat`, `kvpipe top`, `kvpipe bench serve
--url`, `kvpipe bench soak` / `chaos`), and the stack keys file they find them in.

Where a client finds a key (each of the two on its own, the first that has it):
1. `$KVPIPE_API_KEY` (the user key) and `$KVPIPE_ADMIN_API_KEY` (the admin key);
2. the keys file of the stack that serves the URL it talks to. A stack started with keys (`kvpipe
   launch` does by default) writes one into the run directory (RUN_DIR_ENV, else
   `$XDG_RUNTIME_DIR/kvpipe`, else `~/.cache/kvpipe/run`; mode 0700, the file 0600) and removes
   it when it stops; a file whose stack process is gone is skipped and removed by the next start.
   The file is shell: `. FILE` exports both keys plus `OPENAI_API_KEY` / `OPENAI_BASE_URL`, what
   OpenAI SDK clients read (vLLM and SGLang users' habit), and `KVPIPE_STACK_URLS`, the router's and
   every server's URL, by which clients find it.

Which key a call carries: what a user does (inference, /v1/models) the user key, which is the
only one sglang-router takes for it (its control-plane admin key is refused there); what only an
admin may (the router's /workers, a server's /debug/* and full /server_info) the admin key. Each
falls back to the other when only one is known.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

API_KEY_ENV = "KVPIPE_API_KEY"  # read when --api-key is not given: it stays out of process lists
ADMIN_API_KEY_ENV = "KVPIPE_ADMIN_API_KEY"  # likewise for --admin-api-key
RUN_DIR_ENV = "KVPIPE_RUN_DIR"  # where stacks leave their keys files (tests point it at a temp dir)
STACK_URLS_VAR = "KVPIPE_STACK_URLS"
STACK_PID_VAR = "KVPIPE_STACK_PID"
MAX_FILES = 256  # keys files read per look-up, at most
MAX_FILE_BYTES = 64 << 10


@dataclass(frozen=True)
class StackKeys:
    """A stack's user key (inference) and admin key (admin routes, the router's control plane)."""

    user: str | None = field(default=None, repr=False)
    admin: str | None = field(default=None, repr=False)

    def headers(self, admin: bool = False) -> dict[str, str]:
        """`Authorization: Bearer` with the key for the call (`admin`: an admin's), else the other one."""
        key = (self.admin or self.user) if admin else (self.user or self.admin)
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class KeysFile:
    keys: StackKeys
    urls: tuple[str, ...]
    pid: int | None


def run_dir(environ: Mapping[str, str] = os.environ) -> Path:
    if environ.get(RUN_DIR_ENV):
        return Path(environ[RUN_DIR_ENV])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "kvpipe"
    return Path.home() / ".cache" / "kvpipe" / "run"


def _endpoint(url: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) URL; localhost is 127.0.0.1 (what `kvpipe launch` binds)."""
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    return ("127.0.0.1" if host == "localhost" else host), port


def keys_file_path(router_url: str, environ: Mapping[str, str] = os.environ) -> Path:
    """Where the stack whose router is at `router_url` keeps its keys."""
    host, port = _endpoint(router_url) or ("unknown", 0)
    return run_dir(environ) / f"stack-{host.replace(':', '_')}-{port}.env"


def write_keys_file(path: Path, keys: StackKeys, router_url: str, urls: Iterable[str], pid: int) -> None:
    """The keys file (0600 from its creation, in a 0700 directory), replaced atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    values = {
        API_KEY_ENV: keys.user,
        ADMIN_API_KEY_ENV: keys.admin,
        "OPENAI_API_KEY": keys.user or keys.admin,
        "OPENAI_BASE_URL": router_url.rstrip("/") + "/v1",
        STACK_URLS_VAR: " ".join(urls),
        STACK_PID_VAR: str(pid),
    }
    lines = [f"# the HTTP API keys of the kvpipe stack at {router_url}: `. {path}` exports them", ""]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in values.items() if value]
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def read_keys_file(path: Path) -> KeysFile | None:
    """The file's keys, URLs and stack pid; None when it is unreadable or not a keys file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_FILE_BYTES)
        words = [shlex.split(line, comments=True) for line in text.splitlines()]
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    values: dict[str, str] = {}
    for w in words:
        if len(w) == 2 and w[0] == "export" and "=" in w[1]:
            name, _, value = w[1].partition("=")
            values[name] = value
    if STACK_URLS_VAR not in values:
        return None
    pid = values.get(STACK_PID_VAR, "")
    keys = StackKeys(values.get(API_KEY_ENV) or None, values.get(ADMIN_API_KEY_ENV) or None)
    return KeysFile(keys, tuple(values[STACK_URLS_VAR].split()), int(pid) if pid.isdigit() else None)


def alive(pid: int | None) -> bool:
    if pid is None:
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stack_files(directory: Path) -> list[Path]:
    try:
        return sorted(directory.glob("stack-*.env"))[:MAX_FILES]
    except OSError:
        return []


def remove_stale_keys_files(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """Remove the keys files of stacks whose process is gone (killed without its clean-up)."""
    gone = []
    for path in _stack_files(run_dir(environ)):
        kf = read_keys_file(path)
        if kf is not None and not alive(kf.pid):
            with contextlib.suppress(OSError):
                path.unlink()
                gone.append(path)
    return gone


def stack_keys_for(url: str, environ: Mapping[str, str] = os.environ) -> StackKeys:
    """The keys of the running stack one of whose URLs is `url` (none when no such file)."""
    want = _endpoint(url)
    if want is None:
        return StackKeys()
    for path in _stack_files(run_dir(environ)):
        kf = read_keys_file(path)
        if kf is not None and want in {_endpoint(u) for u in kf.urls} and alive(kf.pid):
            return kf.keys
    return StackKeys()


def client_keys(url: str | None = None, environ: Mapping[str, str] = os.environ) -> StackKeys:
    """The keys a client of `url` sends: the environment's, else the keys file's (see module doc)."""
    user, admin = environ.get(API_KEY_ENV) or None, environ.get(ADMIN_API_KEY_ENV) or None
    if url is not None and (user is None or admin is None):
        found = stack_keys_for(url, environ)
        user, admin = user or found.user, admin or found.admin
    return StackKeys(user, admin)


def client_headers(
    environ: Mapping[str, str] = os.environ, *, url: str | None = None, admin: bool = False
) -> dict[str, str]:
    """What kvpipe's own clients send to `url`: `Authorization: Bearer <key>`, the user key for what
    a user does, the admin key for an admin's read (`admin`), else the other one, else nothing."""
    return client_keys(url, environ).headers(admin)
