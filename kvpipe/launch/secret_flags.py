"""A stack's secrets: the PD control plane's shared token and the HTTP API's user and admin keys.
Given as flags they leave the command lines, which every user of the machine can read in /proc,
and reach the servers and the router through their environment instead (the router through
router_main.py, which hands them to sglang-router in-process).

With `new_keys` (`kvpipe launch` unless --no-api-keys, `kvpipe bench soak` and `chaos`) a stack
always has both keys: the ones given (flags, key files or $KVPIPE_API_KEY / $KVPIPE_ADMIN_API_KEY),
else fresh random ones; the token is always the stack's own random one unless one is given.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpipe.config import ConfigError
from kvpipe.launch.core_split import has_flag
from kvpipe.server.client_keys import ADMIN_API_KEY_ENV, API_KEY_ENV, StackKeys
from kvpipe.server.server_keys import given_keys
from kvpipe.transfer.control.auth import TOKEN_ENV, new_token

AUTH_TOKEN_FLAG = "--disaggregation-auth-token"
AUTH_TOKEN_FILE_FLAG = "--disaggregation-auth-token-file"
API_KEY_FLAG = "--api-key"
# the HTTP API's key flags (commands/http_flags.py) a stack takes off its servers' command lines
KEY_FLAGS = ("--api-key", "--api-key-file", "--admin-api-key", "--admin-api-key-file")


def take_secret_flag(args: Sequence[str], flag: str = AUTH_TOKEN_FLAG) -> tuple[list[str], str | None]:
    """`args` without a secret's flag (`--flag V` or `--flag=V`), and its value (the last one)."""
    rest: list[str] = []
    value = None
    it = iter(args)
    for a in it:
        if a == flag:
            value = next(it, None)
        elif a.startswith(flag + "="):
            value = a.partition("=")[2]
        else:
            rest.append(a)
    return rest, value


def new_api_key(role: str) -> str:
    """A random key that says what it is (`kvpipe-user-...`), so secret scanners and people can tell."""
    return f"kvpipe-{role}-{secrets.token_urlsafe(24)}"


@dataclass(frozen=True)
class StackSecrets:
    """What every server of a stack gets in its environment (restarts too, so survivors trust them)."""

    token: str | None = field(default=None, repr=False)  # None: the servers read a token file
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    generated: tuple[str, ...] = ()  # which keys are fresh random ones ("user", "admin")

    @property
    def keys(self) -> StackKeys:
        return StackKeys(self.api_key, self.admin_key)

    def env(self) -> tuple[tuple[str, str], ...]:
        """The servers': the token and both keys."""
        return tuple((name, value) for name, value in ((TOKEN_ENV, self.token), *self.router_env()) if value)

    def router_env(self) -> tuple[tuple[str, str], ...]:
        """The router's (router_main.py): the key it sends its workers and asks its clients for, and
        its control plane's admin key."""
        pairs = ((API_KEY_ENV, self.api_key), (ADMIN_API_KEY_ENV, self.admin_key))
        return tuple((name, value) for name, value in pairs if value)


@dataclass(frozen=True)
class StackArgs:
    """The servers' flags without their secrets: every server's, the prefills' and the decodes'."""

    server: list[str]
    prefill: list[str]
    decode: list[str]


def _take_keys(server: list[str], environ: Mapping[str, str]) -> tuple[list[str], str | None, str | None]:
    """The servers' flags without the key flags, the user key and the admin key (flag, file or
    environment, as `kvpipe serve` reads them: server_keys.given_keys)."""
    taken: dict[str, str | None] = {}
    for flag in KEY_FLAGS:
        server, taken[flag] = take_secret_flag(server, flag)
    users = given_keys(taken["--api-key"], taken["--api-key-file"], API_KEY_ENV, environ, "--api-key")
    admins = given_keys(
        taken["--admin-api-key"], taken["--admin-api-key-file"], ADMIN_API_KEY_ENV, environ, "--admin-api-key"
    )
    if len(users) > 1:
        raise ConfigError(
            "a stack's router sends its servers one key, so every request through it carries that one: "
            "give the stack one user key (--api-key, a --api-key-file of one line, or $KVPIPE_API_KEY)"
        )
    return server, next(iter(users), None), next(iter(admins), None)


def split_secrets(
    server_args: Sequence[str],
    prefill_args: Sequence[str],
    decode_args: Sequence[str],
    new_keys: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> tuple[StackArgs, StackSecrets]:
    """The flags without the secrets' flags, and the stack's secrets: the token given (in any of
    the three; they must agree), else $KVPIPE_DISAGGREGATION_AUTH_TOKEN, else one random token for the
    stack, unless the servers read theirs from a token file; the keys given, else (`new_keys`)
    random ones."""
    server, token = take_secret_flag(server_args)
    prefill, p_token = take_secret_flag(prefill_args)
    decode, d_token = take_secret_flag(decode_args)
    if len({t for t in (token, p_token, d_token) if t}) > 1:
        raise ConfigError("prefill and decode need the same --disaggregation-auth-token")
    token = token or p_token or d_token
    server, api_key, admin_key = _take_keys(server, environ)
    generated = []
    if new_keys and api_key is None:
        api_key = new_api_key("user")
        generated.append("user")
    if new_keys and admin_key is None:
        admin_key = new_api_key("admin")
        generated.append("admin")
    if api_key is not None and api_key == admin_key:
        raise ConfigError("the user and the admin key must differ")
    if token or not has_flag(server, AUTH_TOKEN_FILE_FLAG):
        token = token or environ.get(TOKEN_ENV) or new_token()
    return StackArgs(server, prefill, decode), StackSecrets(token, api_key, admin_key, tuple(generated))
