"""A stack's secrets: the PD control plane's shared token and the servers' API key. Given as flags
they leave the command lines, which every user of the machine can read in /proc, and reach the
servers through their environment instead (sglang-router takes the API key as a flag only)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpipe.config import ConfigError
from kvpipe.launch.core_split import has_flag
from kvpipe.server.api_key import API_KEY_ENV, api_key_from_env
from kvpipe.transfer.control.auth import TOKEN_ENV, new_token

AUTH_TOKEN_FLAG = "--disaggregation-auth-token"
AUTH_TOKEN_FILE_FLAG = "--disaggregation-auth-token-file"
API_KEY_FLAG = "--api-key"


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


@dataclass(frozen=True)
class StackSecrets:
    """What every server of a stack gets in its environment (restarts too, so survivors trust them)."""

    token: str | None = field(default=None, repr=False)  # None: the servers read a token file
    api_key: str | None = field(default=None, repr=False)

    def env(self) -> tuple[tuple[str, str], ...]:
        return tuple((name, value) for name, value in ((TOKEN_ENV, self.token), (API_KEY_ENV, self.api_key)) if value)


@dataclass(frozen=True)
class StackArgs:
    """The servers' flags without their secrets: every server's, the prefills' and the decodes'."""

    server: list[str]
    prefill: list[str]
    decode: list[str]


def split_secrets(
    server_args: Sequence[str], prefill_args: Sequence[str], decode_args: Sequence[str]
) -> tuple[StackArgs, StackSecrets]:
    """The flags without the secrets' flags, and the stack's secrets: the token given (in any of
    the three; they must agree), else $KVPIPE_DISAGGREGATION_AUTH_TOKEN, else one random token for the
    stack, unless the servers read theirs from a token file; the API key given, else our own."""
    server, token = take_secret_flag(server_args)
    prefill, p_token = take_secret_flag(prefill_args)
    decode, d_token = take_secret_flag(decode_args)
    if len({t for t in (token, p_token, d_token) if t}) > 1:
        raise ConfigError("prefill and decode need the same --disaggregation-auth-token")
    token = token or p_token or d_token
    server, api_key = take_secret_flag(server, API_KEY_FLAG)
    if token or not has_flag(server, AUTH_TOKEN_FILE_FLAG):
        token = token or os.environ.get(TOKEN_ENV) or new_token()
    return StackArgs(server, prefill, decode), StackSecrets(token, api_key or api_key_from_env())
