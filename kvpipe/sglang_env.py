"""SGLang's environment variables, read as defaults of the flags they match (a given flag wins).

A deployment written for SGLang sets part of its PD behaviour through SGLANG_* variables, not
flags. Each variable SGLang's disaggregation code (and its layer-pipelining PRs) reads is in
`SGLANG_ENV`: those with a meaning here set the default of the matching flag, converted from
SGLang's unit; the others are named with the reason they are ignored, and a server that finds one
set logs a line saying so. docs/flags.md (generated) lists the same variables and flags
(tests/unit/test_sglang_env.py keeps the two equal).

    parser.set_defaults(**flag_defaults(os.environ))   # ConfigError naming a malformed variable
    log_sglang_env(os.environ, logger)                 # once logging is set up
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpipe.config import STAGING_MODES, ConfigError

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "y"), ("0", "false", "no", "n")  # SGLang's EnvBool


@dataclass(frozen=True)
class LayersPerGroup:
    """SGLANG_PIPELINE_GROUP_SIZE: layers per group (SGLang's unit). kvpipe's flag counts groups,
    so the value becomes a count once the served model's depth is known."""

    layers: int

    def groups(self, num_layers: int) -> int:
        return max(1, -(-num_layers // self.layers))


@dataclass(frozen=True)
class EnvVar:
    name: str
    flag: str | None  # the flag whose default it sets; None: ignored here
    meaning: str  # meaning and unit; for an ignored variable, why
    # the text -> the flag's value (ValueError saying what is wrong); None from it: no default
    parse: Callable[[str], Any] | None = None

    @property
    def dest(self) -> str:
        assert self.flag is not None
        return self.flag.removeprefix("--").replace("-", "_")


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _seconds(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise ValueError("seconds must be positive")
    return value


def _whole(text: str, low: int) -> int:
    value = int(text)
    if value < low:
        raise ValueError(f"must be an integer >= {low}")
    return value


def _count(text: str) -> int:
    return _whole(text, 1)


def _tokens(text: str) -> int:
    return _whole(text, 0)


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(f"not a boolean (one of {', '.join(TRUE_WORDS + FALSE_WORDS)})")


def _staging(text: str) -> str:
    word = text.strip().lower()
    if word in STAGING_MODES:
        return word
    return "on" if _bool(word) else "off"


def _probability(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("a probability must be in [0, 1]")
    return value


def _pipelining(text: str) -> int | None:
    # off: the plain path; on: kvpipe's default (auto) or SGLANG_PIPELINE_GROUP_SIZE's count
    return None if _bool(text) else 1


def _group_size(text: str) -> LayersPerGroup | int:
    layers = int(text)
    return LayersPerGroup(layers) if layers > 0 else 1  # SGLang: not positive -> the plain path


def _ignored(name: str, why: str) -> EnvVar:
    return EnvVar(name, None, why)


GROUPS = "--disaggregation-layer-groups"
SGLANG_ENV: tuple[EnvVar, ...] = (
    EnvVar(
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
        "--disaggregation-bootstrap-timeout",
        "seconds: the prefill waits this long for a request's decode to send its page indices, the "
        "decode this long to reach the prefill and send them (SGLang reads whole seconds)",
        _seconds,
    ),
    EnvVar(
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
        "--disaggregation-waiting-timeout",
        "seconds a decode request may wait for free pages, then for its KV",
        _seconds,
    ),
    EnvVar(
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
        "--disaggregation-heartbeat-interval",
        "seconds between heartbeats (SGLang raises values under 2 to 2; kvpipe takes them as given)",
        _seconds,
    ),
    EnvVar(
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
        "--disaggregation-heartbeat-max-failure",
        "missed heartbeats in a row after which a peer is dead (a count >= 1)",
        _count,
    ),
    EnvVar(
        "SGLANG_DISAGG_STAGING_BUFFER",
        "--disaggregation-staging-buffer",
        "boolean: 1/true/yes/y is on, 0/false/no/n is off (kvpipe's on, off and auto are read too)",
        _staging,
    ),
    EnvVar(
        "SGLANG_DISAGG_STAGING_POOL_SIZE_MB",
        "--disaggregation-staging-pool-size-mb",
        "MiB per TP rank: a decode's staging ring (all SGLang sizes with it) and a prefill's local staging buffer",
        _count,
    ),
    EnvVar(
        "SGLANG_ENABLE_PIPELINED_KV_TRANSFER",
        GROUPS,
        "boolean: off is 1 (the plain path, no layer pipelining); on keeps auto, or SGLANG_PIPELINE_GROUP_SIZE's count",
        _pipelining,
    ),
    EnvVar(
        "SGLANG_PIPELINED_KV_TRANSFER",
        GROUPS,
        "the same switch, under the name of SGLang's earlier layer-pipelining PR",
        _pipelining,
    ),
    EnvVar(
        "SGLANG_PIPELINE_GROUP_SIZE",
        GROUPS,
        "layers per group: the prefill runs ceil(layers of the served model / value) groups; "
        "0 or less is the plain path",
        _group_size,
    ),
    EnvVar(
        "SGLANG_PIPELINE_MIN_TOKENS",
        "--disaggregation-layer-groups-min-tokens",
        "prompt tokens: with auto, a prefill batch with fewer new tokens takes the plain path",
        _tokens,
    ),
    EnvVar(
        "SGLANG_TEST_DISAGG_FAILURE_PROB",
        "--disaggregation-failure-prob",
        "test knob: probability in [0, 1] that a KV transfer fails "
        "(SGLang draws per status poll, kvpipe per write batch)",
        _probability,
    ),
    *(
        _ignored(
            name,
            "a bound of SGLang's token ramp for the group count: kvpipe's auto picks the count "
            "from measured compute and link speed",
        )
        for name in ("SGLANG_PIPELINE_MAX_ITERS", "SGLANG_PIPELINE_MIN_ITERS", "SGLANG_PIPELINE_SAT_MULTIPLIER")
    ),
    _ignored(
        "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE",
        "threads of SGLang's blocking KV sends: kvpipe's sender submits asynchronous batches from one worker per rank",
    ),
    _ignored(
        "SGLANG_DISAGGREGATION_QUEUE_SIZE",
        "SGLang's transfer queues (sharded by destination): a kvpipe sender has one, bounded by in-flight ops",
    ),
    _ignored(
        "SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT",
        "seconds a ZMQ send may block: kvpipe's control-plane sends never block (a full per-peer queue drops)",
    ),
    _ignored("SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS", "kvpipe keeps one control-plane socket per peer"),
    _ignored(
        "SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT",
        "seconds the transfer engine may take to start: kvpipe starts Mooncake without a deadline",
    ),
    *(
        _ignored(name, "NIXL transport: kvpipe has the mooncake and local backends")
        for name in ("SGLANG_DISAGGREGATION_NIXL_BACKEND", "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS")
    ),
    _ignored("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "context parallelism: kvpipe has none"),
    _ignored("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "data-parallel attention: kvpipe has none"),
    _ignored(
        "SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS",
        "sampling masks in SGLang's metadata buffers: kvpipe's first-token message carries none",
    ),
    _ignored(
        "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL",
        "kvpipe's bootstrap server holds one entry per prefill rank, replaced when the prefill restarts",
    ),
    _ignored(
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
        "kvpipe always keeps an aborted request's decode pages until no write to them can land",
    ),
    _ignored(
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT",
        "kvpipe bounds that wait with --disaggregation-transfer-timeout, which on a prefill also bounds a stalled "
        "write, so it is not read from this variable",
    ),
    _ignored(
        "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX",
        "kvpipe has no switch for when a cached prefix's pages are sent",
    ),
    _ignored(
        "SGLANG_STAGING_USE_TORCH", "SGLang's torch fallback for its Triton staging kernels: kvpipe stages with torch"
    ),
    _ignored(
        "SGLANG_MOONCAKE_CUSTOM_MEM_POOL",
        "GPU memory pools (NVLink, Barex) for Mooncake: kvpipe registers its own KV pool memory",
    ),
    _ignored(
        "SGLANG_MOONCAKE_SEND_AUX_TCP",
        "SGLang's route for its aux data (the first token): kvpipe's is fixed",
    ),
)


def flag_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """argparse dest -> default, from the variables of `SGLANG_ENV` set in `environ`. Where several
    set one flag, the first in the table whose value gives a default wins."""
    out: dict[str, Any] = {}
    for var in SGLANG_ENV:
        text = environ.get(var.name)
        if text is None or var.parse is None:
            continue
        try:
            value = var.parse(text.strip())
        except ValueError as e:
            raise ConfigError(f"{var.name}={text!r} is not a valid default of {var.flag}: {e}") from e
        if value is not None:
            out.setdefault(var.dest, value)
    return out


def log_sglang_env(environ: Mapping[str, str], log: logging.Logger) -> None:
    """One line per variable of `SGLANG_ENV` set in `environ`: the flag it defaults, or why it is ignored."""
    for var in SGLANG_ENV:
        if var.name not in environ:
            continue
        if var.flag is None:
            log.warning("%s is set but ignored: %s", var.name, var.meaning)
        else:
            log.info("%s=%s is the default of %s (a given flag wins)", var.name, environ[var.name], var.flag)
