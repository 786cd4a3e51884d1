"""SGLang native `/generate` schema, the sampling-parameter checks, and the normalised request.

Wire schemas are strict pydantic models (a string where a number belongs is an error, not a
coercion) that ignore unknown fields: sglang-router rebuilds request bodies and adds fields of
its own. `GenerateInput` is what the rest of the server works with: one prompt, tokenised,
validated, with its engine `SamplingParams` and the PD bootstrap fields carried through.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

from pydantic import BaseModel, ConfigDict

from kvpipe.config import RequestLimits
from kvpipe.engine.request import SamplingParams
from kvpipe.server.errors import APIError

MAX_SEED = 2**63 - 1
DEFAULT_LIMITS = RequestLimits()


class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SamplingParamsIn(WireModel):
    """SGLang's `sampling_params` object; None means "use the default"."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None


class GenerateRequest(WireModel):
    """Body of `POST /generate`: one prompt, or a batch when `text`/`input_ids` is a list of prompts."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    stream: bool | None = False  # null (a rebuilt body's unset field) means the default
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    rid: str | list[str] | None = None
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None
    # meta_info.timeline: where the request's time went on this server (kvpipe/engine/timeline.py);
    # SGLang only logs such stats server-wide (--enable-request-time-stats-logging)
    return_timeline: bool | None = False
    cache_salt: str | None = None  # vLLM's: prefixes are shared only with requests of the same salt


class AbortRequest(WireModel):
    """Body of `POST /abort_request`: one request by rid, or all of them (admins only)."""

    rid: str | None = None
    abort_all: bool = False


@dataclass(frozen=True)
class BootstrapInfo:
    """Where a PD request's KV comes from (injected by the router); unused by a colocated server."""

    host: str | None = None
    port: int | None = None
    room: int | None = None


@dataclass(frozen=True)
class TextOptions:
    """How generated tokens become text."""

    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep a matched stop string at the end of the text


@dataclass(frozen=True)
class GenerateInput:
    """One validated prompt, ready for the engine."""

    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool = False
    text_options: TextOptions = TextOptions()
    bootstrap: BootstrapInfo | None = None
    index: int = 0  # position in a batched request
    return_timeline: bool = False
    owner: str | None = None  # Caller.key_id of the user key that sent it (abort by rid); None: any
    # the prefix-cache namespace (api_key.tenant_salt): prefixes are shared only within one
    cache_salt: str | None = None


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a (maybe batched) request before tokenisation and limit checks."""

    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParamsIn
    rid: str
    return_logprob: bool
    bootstrap: BootstrapInfo | None


# /generate's fields that hold one entry per prompt when they are lists
GENERATE_BATCH_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)


def check_batch_size(body: Any, fields: tuple[str, ...], limits: RequestLimits) -> None:
    """Refuse a batch of more prompts than --max-prompts-per-request from the parsed JSON, before
    validation walks it (a 4.8 MB body once held a million prompts). A list of token ids is one
    prompt, not a batch (`input_ids`, `prompt`): a batch of them is a list of lists."""
    if not isinstance(body, dict):
        return  # validation refuses it
    cap = limits.max_prompts_per_request
    for name in fields:
        value = body.get(name)
        if not isinstance(value, list) or len(value) <= cap:
            continue
        if name in ("input_ids", "prompt") and isinstance(value[0], int):
            continue  # one prompt of token ids: its length is checked against the context
        raise APIError(
            f"{name} holds {len(value)} entries: a request may batch at most {cap} prompts (--max-prompts-per-request)",
            param=name,
        )


def check_stops(stop: tuple[str, ...], stop_ids: tuple[int, ...], limits: RequestLimits) -> None:
    """The engine searches every stop string after every token: cap their count and length."""
    if len(stop) > limits.max_stop_strings:
        raise APIError(
            f"{len(stop)} stop strings: at most {limits.max_stop_strings} are allowed (--max-stop-strings)",
            param="stop",
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise APIError(
            f"a stop string of {longest} characters: at most {limits.max_stop_string_chars} are allowed "
            "(--max-stop-string-chars)",
            param="stop",
        )
    if len(stop_ids) > limits.max_stop_token_ids:
        raise APIError(
            f"{len(stop_ids)} stop_token_ids: at most {limits.max_stop_token_ids} are allowed (--max-stop-token-ids)",
            param="stop_token_ids",
        )


def new_rid() -> str:
    return uuid.uuid4().hex


def pick(value: Any, i: int, n: int, name: str) -> Any:
    """Element i of a per-prompt list, or the scalar shared by the whole batch."""
    if isinstance(value, list):
        if len(value) != n:
            raise APIError(f"{name} has {len(value)} entries for a batch of {n} prompts", param=name)
        return value[i]
    return value


def _is_token_batch(ids: list[int] | list[list[int]]) -> TypeGuard[list[list[int]]]:
    """A batch of token prompts: strict validation took the list as wholly one shape, so the
    first item tells which."""
    return bool(ids) and isinstance(ids[0], list)


def split_generate_request(req: GenerateRequest) -> tuple[list[PromptSpec], bool]:
    """Normalise a `/generate` body into per-prompt specs; the flag says the reply is a list."""
    body_text, body_ids = req.text, req.input_ids
    if body_text is not None and body_ids is not None:
        raise APIError("give either text or input_ids, not both", param="text")
    prompts: list[tuple[str | None, list[int] | None]]
    if isinstance(body_text, list):
        batched, prompts = True, [(t, None) for t in body_text]
    elif body_text is not None:
        batched, prompts = False, [(body_text, None)]
    elif body_ids is not None and _is_token_batch(body_ids):
        batched, prompts = True, [(None, list(x)) for x in body_ids]
    elif body_ids is not None:
        # strict validation took the whole list as one shape: not a batch means list[int]
        batched, prompts = False, [(None, list(cast("list[int]", body_ids)))]
    else:
        raise APIError("one of text or input_ids is required", param="text")
    if batched and not prompts:
        raise APIError("empty batch", param="text" if req.text is not None else "input_ids")
    n = len(prompts)
    for name in ("top_logprobs_num",):
        for i in range(n):
            if (pick(getattr(req, name), i, n, name) or 0) > 0:
                raise APIError("top_logprobs_num > 0 is not supported", param=name)
    if not batched and isinstance(req.rid, list):
        raise APIError("rid must be a string for a single prompt", param="rid")
    specs = []
    for i, (text, ids) in enumerate(prompts):
        boot = BootstrapInfo(
            pick(req.bootstrap_host, i, n, "bootstrap_host"),
            pick(req.bootstrap_port, i, n, "bootstrap_port"),
            pick(req.bootstrap_room, i, n, "bootstrap_room"),
        )
        has_boot = boot.host is not None or boot.port is not None or boot.room is not None
        specs.append(
            PromptSpec(
                text=text,
                input_ids=ids,
                sampling=pick(req.sampling_params, i, n, "sampling_params") or SamplingParamsIn(),
                rid=pick(req.rid, i, n, "rid") or new_rid(),
                return_logprob=bool(pick(req.return_logprob, i, n, "return_logprob")),
                bootstrap=boot if has_boot else None,
            )
        )
    rids = [s.rid for s in specs]
    if len(set(rids)) != len(rids):
        raise APIError("duplicate rid inside one batch", param="rid")
    return specs, batched


def to_sampling_params(
    sp: SamplingParamsIn, default_max_new_tokens: int, limits: RequestLimits = DEFAULT_LIMITS
) -> SamplingParams:
    """Check ranges (SGLang's rules) and the server's caps, and build the engine's frozen
    SamplingParams."""
    max_new = default_max_new_tokens if sp.max_new_tokens is None else sp.max_new_tokens
    if max_new < 1:
        raise APIError(f"max_new_tokens must be at least 1, got {max_new}", param="max_new_tokens")
    temperature = 1.0 if sp.temperature is None else sp.temperature
    if not temperature >= 0.0:  # also rejects NaN
        raise APIError(f"temperature must be non-negative, got {temperature}", param="temperature")
    top_p = 1.0 if sp.top_p is None else sp.top_p
    if not 0.0 < top_p <= 1.0:
        raise APIError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = -1 if sp.top_k in (None, 0) else sp.top_k
    if top_k < -1:
        raise APIError(f"top_k must be -1 (disabled) or at least 1, got {top_k}", param="top_k")
    min_p = 0.0 if sp.min_p is None else sp.min_p
    if not 0.0 <= min_p <= 1.0:
        raise APIError(f"min_p must be in [0, 1], got {min_p}", param="min_p")
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    if any(s == "" for s in stop):
        raise APIError("stop strings must not be empty", param="stop")
    stop_ids = tuple(sp.stop_token_ids or ())
    check_stops(stop, stop_ids, limits)
    if any(t < 0 for t in stop_ids):
        raise APIError("stop_token_ids must be non-negative", param="stop_token_ids")
    if sp.seed is not None and not 0 <= sp.seed <= MAX_SEED:
        raise APIError(f"seed must be in [0, 2**63), got {sp.seed}", param="seed")
    if sp.n not in (None, 1):
        raise APIError("only n=1 is supported", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(sp, name) not in (None, 0.0):
            raise APIError(f"{name} is not supported (must be 0)", param=name)
    if sp.repetition_penalty not in (None, 1.0):
        raise APIError("repetition_penalty is not supported (must be 1)", param="repetition_penalty")
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(sp.ignore_eos),
        seed=sp.seed,
    )


def text_options(sp: SamplingParamsIn) -> TextOptions:
    return TextOptions(skip_special_tokens=sp.skip_special_tokens is not False, no_stop_trim=bool(sp.no_stop_trim))
