"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (with SSE)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvpipe.config import ConfigError
from kvpipe.engine.request import ABORTED_ON_REQUEST, FinishReason
from kvpipe.server.app_state import ServerState
from kvpipe.server.drain import is_drain_abort
from kvpipe.server.errors import APIError
from kvpipe.server.openai_protocol import (
    COMPLETION_BATCH_FIELDS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    _OpenAIBase,
)
from kvpipe.server.openapi_schema import BODY_ROUTE_RESPONSES, json_body
from kvpipe.server.protocol import GenerateInput, check_batch_size, new_rid, text_options, to_sampling_params
from kvpipe.server.request_tracker import RequestOutput
from kvpipe.server.streaming import (
    SSE_DONE,
    ClosingStreamingResponse,
    close_all,
    merge_streams,
    read_json,
    sse,
    sse_error,
)
from kvpipe.server.validation import check_prompt_chars, finalize_input, with_default_max_tokens
from kvpipe.transfer.control.handshake import refusal_status


def _finish_fields(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's `finish_reason` ("stop" / "length" / "abort", null while running), plus SGLang's
    `matched_stop` (the stop string or token id) when it stopped."""
    fields: dict[str, Any] = {"finish_reason": None if out.finish_reason is None else out.finish_reason.value}
    if out.finish_reason is FinishReason.STOP:
        fields["matched_stop"] = out.finish_detail
    return fields


def _failure(out: RequestOutput) -> APIError | None:
    """An OpenAI answer has no place for why a request was aborted: one the server gave up on (a
    failed KV transfer, no KV pages in time, a prompt the KV cache cannot hold) is an error with
    that reason, as on a PD prefill; one aborted on request keeps finish_reason "abort"."""
    if out.finish_reason is FinishReason.ABORT and out.finish_detail not in (None, ABORTED_ON_REQUEST):
        status = 503 if is_drain_abort(out) else refusal_status(out.finish_detail) or 500
        return APIError(f"request {out.rid} failed: {out.finish_detail}", status)
    return None


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)},
    }


class _Responder:
    """Builds response objects and SSE chunks for one OpenAI request."""

    def __init__(self, state: ServerState, kind: str, rid: str, want_logprobs: bool, want_meta: bool = False) -> None:
        self.state, self.kind, self.want_logprobs, self.want_meta = state, kind, want_logprobs, want_meta
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}"
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _token_text(self, t: int) -> str:
        return self.state.tokenizer.decode([t], skip_special_tokens=False)

    def logprobs(self, out: RequestOutput, start: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        ids, lps = out.output_ids[start:], out.output_logprobs[start:]
        toks = [self._token_text(t) for t in ids]
        if self.kind == "chat":
            # `bytes` is how a client rebuilds characters split across tokens: the token's own
            # bytes, not those of its lossy text (U+FFFD for part of a character)
            tok = self.state.tokenizer
            return {
                "content": [
                    {"token": s, "logprob": lp, "bytes": list(tok.token_bytes(t)), "top_logprobs": []}
                    for s, t, lp in zip(toks, ids, lps)
                ]
            }
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": None}

    def body(self, outs: list[RequestOutput]) -> dict[str, Any]:
        for out in outs:
            error = _failure(out)
            if error is not None:
                raise error
        choices = []
        for out in outs:
            c: dict[str, Any] = {"index": out.index}
            if self.kind == "chat":
                c["message"] = {"role": "assistant", "content": out.text}
            else:
                c["text"] = out.text
            c.update(logprobs=self.logprobs(out), **_finish_fields(out))
            if self.want_meta:
                c["meta_info"] = out.meta_info()
            choices.append(c)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.state.cfg.model_name,
            "choices": choices,
            "usage": _usage(outs),
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, include_usage: bool) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.state.cfg.model_name,
            "choices": choices,
        }
        if include_usage:
            obj["usage"] = usage
        return sse(obj)

    def delta_choice(self, out: RequestOutput) -> dict[str, Any] | None:
        """The streamed choice for one update; None when there is nothing to say."""
        if not out.delta_text and not out.finished and not (self.want_logprobs and out.num_new_ids):
            return None
        start = out.completion_tokens - out.num_new_ids
        c: dict[str, Any] = {"index": out.index}
        if self.kind == "chat":
            c["delta"] = {"content": out.delta_text} if out.delta_text else {}
        else:
            c["text"] = out.delta_text
        c.update(logprobs=self.logprobs(out, start), **_finish_fields(out))
        return c


# sglang-router's OpenAI request types default an absent `model` to this name: it means "not given"
ROUTER_NO_MODEL = "unknown"


def _check_model(state: ServerState, req: _OpenAIBase) -> None:
    if req.model is not None and req.model not in (state.cfg.model_name, state.cfg.model_path, ROUTER_NO_MODEL):
        raise APIError(
            f"The model `{req.model}` does not exist; this server serves `{state.cfg.model_name}`", 404, param="model"
        )


def _build_inputs(
    state: ServerState,
    req: _OpenAIBase,
    rid: str,
    prompts: list[list[int]],
    max_tokens: int | None,
    default_max: int | None,
    want_logprobs: bool,
) -> list[GenerateInput]:
    limits = state.input_limits()
    sp = req.sampling(max_tokens)
    params = to_sampling_params(sp, default_max or 1, state.cfg.limits)
    inputs = []
    for i, ids in enumerate(prompts):
        p = params if default_max is not None else with_default_max_tokens(params, len(ids), limits)
        inputs.append(
            finalize_input(
                rid if len(prompts) == 1 else f"{rid}-{i}",
                ids,
                p,
                limits,
                return_logprob=want_logprobs,
                text_options=text_options(sp),
                bootstrap=req.bootstrap(i, len(prompts)),
                index=i,
            )
        )
    return inputs


async def _respond(
    request: Request, state: ServerState, req: _OpenAIBase, inputs: list[GenerateInput], responder: _Responder
) -> Response:
    if req.stream and req.return_meta_info:  # as SGLang: meta_info comes with a whole answer only
        raise APIError(
            "return_meta_info is not supported with streaming; set stream to false", param="return_meta_info"
        )
    streams = state.submit_all(inputs)
    if not req.stream or state.is_prefill:
        return await state.respond_when_done(request, streams, responder.body)

    include_usage = req.include_usage()

    async def events() -> AsyncIterator[bytes]:
        if responder.kind == "chat":  # OpenAI opens a chat stream with the role
            for inp in inputs:
                yield responder.chunk(
                    [
                        {
                            "index": inp.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    None,
                    include_usage,
                )
        finals: dict[int, RequestOutput] = {}
        try:
            async for out in merge_streams(streams):
                choice = responder.delta_choice(out)
                if choice is not None:
                    yield responder.chunk([choice], None, include_usage)
                if out.finished:
                    finals[out.index] = out
                    error = _failure(out)
                    if error is not None:
                        yield sse_error(error)
        except APIError as e:
            yield sse_error(e)
        if include_usage:
            yield responder.chunk([], _usage(list(finals.values())), True)
        yield SSE_DONE

    return ClosingStreamingResponse(events(), on_close=close_all(streams))


def register_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvpipe",
                    "root": state.cfg.model_name,
                    "max_model_len": state.advertised_context_length(),
                }
            ],
        }

    def prepare_completion(body: Any) -> tuple[CompletionRequest, str, list[GenerateInput]]:
        """Validate and tokenize a /v1/completions body (in a prep thread)."""
        state.check_body(body, "CompletionRequest")
        req = CompletionRequest.model_validate(body)
        req.check_supported()
        _check_model(state, req)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        to_sampling_params(req.sampling(max_tokens), 1, state.cfg.limits)  # refused before tokenizing
        tok, limits = state.tokenizer, state.input_limits()
        prompts = []
        for p in req.prompts():
            if p == "":
                raise APIError("the prompt is empty", param="prompt")
            if isinstance(p, str):
                check_prompt_chars(len(p), limits)
            prompts.append(tok.encode(p) if isinstance(p, str) else p)
        rid = req.rid or new_rid()
        inputs = _build_inputs(
            state, req, rid, prompts, max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, req.logprobs is not None
        )
        return req, rid, inputs

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=BODY_ROUTE_RESPONSES)
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        check_batch_size(body, COMPLETION_BATCH_FIELDS, state.cfg.limits)
        req, rid, inputs = await state.offload(prepare_completion, body)
        inputs = state.for_caller(request, inputs, req.cache_salt)
        return await _respond(
            request,
            state,
            req,
            inputs,
            _Responder(state, "completion", rid, req.logprobs is not None, bool(req.return_meta_info)),
        )

    def prepare_chat(body: Any) -> tuple[ChatCompletionRequest, str, list[GenerateInput]]:
        """Validate a /v1/chat/completions body, render its chat template and tokenize (in a prep
        thread)."""
        state.check_body(body, "ChatCompletionRequest")
        req = ChatCompletionRequest.model_validate(body)
        req.check_supported()
        _check_model(state, req)
        limits = state.input_limits()
        if len(req.messages) > limits.context_length:  # each one costs the template a token or more
            raise APIError(
                f"{len(req.messages)} messages cannot fit the model's context length of {limits.context_length} tokens",
                param="messages",
            )
        check_prompt_chars(req.content_chars(), limits)
        to_sampling_params(req.sampling(req.max_new_tokens()), 1, state.cfg.limits)  # refused before tokenizing
        try:
            ids = state.tokenizer.encode_chat(req.message_dicts())
        except (ValueError, ConfigError, jinja2.TemplateError) as e:
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e
        max_new = req.max_new_tokens()
        # No max tokens: up to the end of the context (default_max=None picks it per prompt).
        rid = req.rid or new_rid()
        return req, rid, _build_inputs(state, req, rid, [ids], max_new, max_new, bool(req.logprobs))

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=BODY_ROUTE_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        req, rid, inputs = await state.offload(prepare_chat, await read_json(request))
        inputs = state.for_caller(request, inputs, req.cache_salt)
        responder = _Responder(state, "chat", rid, bool(req.logprobs), bool(req.return_meta_info))
        return await _respond(request, state, req, inputs, responder)
