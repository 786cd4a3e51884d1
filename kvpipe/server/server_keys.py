"""The HTTP API keys a server is given: a flag, its key file, or the environment.

Apart from kvpipe/server/api_key.py (the server's check, which needs starlette) so that the flag
parsers (kvpipe/commands/http_flags.py, kvpipe/launch/secret_flags.py) import no web framework
and `--help` stays fast.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpipe.config import ConfigError

MAX_KEY_CHARS = 4096


def key_file_lines(path: str, flag: str) -> list[str]:
    """The keys in a key file: one per line, # comments and blank lines skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f.read(1 << 20).splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ConfigError(f"{flag} {path} holds no key")
    if any(len(k) > MAX_KEY_CHARS or " " in k for k in keys):
        raise ConfigError(f"{flag} {path}: a key is one word of at most {MAX_KEY_CHARS} characters per line")
    return keys


def given_keys(flag_value: str | None, path: str | None, env: str, environ: Mapping[str, str], flag: str) -> list[str]:
    """The keys of a flag, or of its file flag (not both), else of the environment."""
    if flag_value is not None and path is not None:
        raise ConfigError(f"give {flag} or {flag}-file, not both")
    if path is not None:
        return key_file_lines(path, f"{flag}-file")
    value = flag_value if flag_value is not None else environ.get(env)
    return [value] if value else []
