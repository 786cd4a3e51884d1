"""What the routes of one server share: its config, the async engine bridge, metrics, PD mode.

Both route modules (`http_server.py`, `openai_api.py`) import this one and neither imports the
other's internals. Routes reach the loaded engine only through the properties here, which
answer 503 while the engine is still loading or after it failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpipe.config import ServerConfig
from kvpipe.engine.cpu_threads import CpuThreads
from kvpipe.engine.request import ABORTED_ON_REQUEST, FinishReason
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.text.tokenizer import Tokenizer
from kvpipe.server.api_key import caller_of, tenant_salt
from kvpipe.server.async_engine import AsyncEngine, EngineLike, RequestStream
from kvpipe.server.body_check import Budget, check_body
from kvpipe.server.drain import DRAIN_DETAIL, DrainControl
from kvpipe.server.errors import APIError
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.protocol import GenerateInput
from kvpipe.server.request_caps import apply_limits, budgets, request_defs
from kvpipe.server.request_tracker import RequestOutput
from kvpipe.server.streaming import ClientDisconnected, close_all, collect, until_disconnect
from kvpipe.server.validation import ModelLimits, longest_token_chars, prompt_chars_cap
from kvpipe.transfer.control.handshake import refusal_status

T = TypeVar("T")

# Threads that parse, validate and tokenize request bodies off the event loop: two keep the loop
# and the engine thread their cores on a small machine while a huge body is worked through.
PREP_THREADS = 2


def _local_dir(path: str | None) -> str | None:
    """sglang-router downloads a tokenizer for any path that is not a local directory: hide those."""
    return os.path.abspath(path) if path and os.path.isdir(path) else None


@dataclass
class ServerState:
    cfg: ServerConfig
    engine: AsyncEngine
    metrics: ServerMetrics
    disaggregation_mode: str = "null"
    cpu_threads: CpuThreads | None = None  # the torch thread plan of this server (/server_info)
    drain: DrainControl | None = None  # its graceful shutdown (drain.py); None: a bare app (tests)
    prep: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="kvpipe-prep"), repr=False
    )
    _token_chars: int | None = field(default=None, init=False, repr=False)  # longest_token_chars, once
    # the request schemas with every cap, the model's too, and the chat budgets (check_body), once
    _caps: tuple[dict[str, Any], dict[str, Budget]] | None = field(default=None, init=False, repr=False)
    _flag_caps: dict[str, Any] | None = field(default=None, init=False, repr=False)  # the flags' caps only

    # ---- the loaded engine (APIError 503 while loading or after a failure) ------------------------
    @property
    def _loaded(self) -> EngineLike:
        return self.engine.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._loaded.model_config

    @property
    def context_length(self) -> int:
        return self._loaded.context_length

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._loaded.eos_token_ids

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=self.model_config.vocab_size, context_length=self.context_length)

    def input_limits(self) -> ModelLimits:
        """`limits` with the prompt-text cap; the first call scans the vocabulary, so call it in
        a prep thread (`offload`)."""
        limits = self.limits
        if self._token_chars is None:
            self._token_chars = longest_token_chars(self.tokenizer)
        return replace(limits, max_prompt_chars=prompt_chars_cap(limits.context_length, self._token_chars))

    def check_body(self, body: Any, model: str, model_caps: bool = True) -> None:
        """Refuse a body whose fields' types or sizes are past a cap (400), before validation,
        templates or tokenization (`body_check.py`). `model_caps`: the loaded model's caps too
        (then call it in a prep thread: `input_limits`); without them, and while the engine loads
        (the route answers 503 after this), it needs no engine."""
        if not model_caps or not self.engine.ready:
            if self._flag_caps is None:
                self._flag_caps = request_defs()
                apply_limits(self._flag_caps, self.cfg.limits)
            return check_body(body, model, self._flag_caps)
        if self._caps is None:
            limits = self.input_limits()
            defs = request_defs()
            apply_limits(defs, self.cfg.limits, limits)
            self._caps = defs, budgets(limits)
        return check_body(body, model, *self._caps)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` (validation, chat templates, tokenization) in a prep thread, so a huge
        body does not hold the event loop that streams every other request's tokens."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, functools.partial(fn, *args))

    # ---- what the info routes report, also while the engine loads ---------------------------------
    def advertised_context_length(self) -> int | None:
        """The engine's context length once loaded; before that, the flag or the model's config."""
        if self.engine.ready:
            return self.context_length
        if self.cfg.scheduler.context_length is not None:
            return self.cfg.scheduler.context_length
        with contextlib.suppress(Exception):
            return model_config_of(self.cfg.model_path).max_position_embeddings
        return None

    def model_paths(self) -> dict[str, str | None]:
        """model_path/tokenizer_path as sglang-router reads them (local directories only, so a
        GGUF file is not reported there), and kvpipe's own `checkpoint_path`: what --model-path
        named, a directory or a .gguf file (what `bench serve --url` reads the vocabulary from)."""
        c = self.cfg
        return {
            "model_path": _local_dir(c.model_path),
            "tokenizer_path": _local_dir(c.tokenizer_path or c.model_path),
            "checkpoint_path": os.path.abspath(c.model_path) if os.path.exists(c.model_path) else None,
        }

    @property
    def draining(self) -> bool:
        return self.drain is not None and self.drain.drain.draining

    # ---- requests ---------------------------------------------------------------------------------
    @property
    def is_prefill(self) -> bool:
        """A PD prefill server answers with one plain JSON body, never a stream (the router
        waits for it before it streams the decode's answer)."""
        return self.disaggregation_mode == "prefill"

    def check_prefill_outputs(self, outs: list[RequestOutput]) -> None:
        """On a prefill server a request that did not hand its KV over is an error response (500),
        except one whose handshake the decode refused: its native answer is SGLang's abort with the
        reason, as the decode's is, because sglang-router 0.3.2 retries every error status of
        either server (a 409 too, measured) and a retry cannot help (the OpenAI routes, which have
        no place for the reason, answer it with 409: openai_api._failure)."""
        if not self.is_prefill:
            return
        for out in outs:
            if out.finish_reason is FinishReason.ABORT and refusal_status(out.finish_detail) is None:
                status = 503 if out.finish_detail == DRAIN_DETAIL else 500  # a drain: another prefill can
                raise APIError(
                    f"prefill of request {out.rid} failed: {out.finish_detail or ABORTED_ON_REQUEST}", status
                )

    def for_caller(self, request: Request, inputs: list[GenerateInput], salt: str | None) -> list[GenerateInput]:
        """`inputs` owned by the request's caller (abort by rid), in its prefix-cache namespace."""
        caller = caller_of(request)
        salt = tenant_salt(caller, salt, self.cfg.cache_salt_by_api_key)
        return [replace(inp, owner=caller.key_id, cache_salt=salt) for inp in inputs]

    def submit_all(self, inputs: list[GenerateInput]) -> list[RequestStream]:
        """Submit a batch all-or-nothing: if one prompt is refused, the others are aborted; a
        batch the server has no room for is refused whole (503 with Retry-After)."""
        self.engine.check_room(len(inputs))
        streams: list[RequestStream] = []
        try:
            for inp in inputs:
                streams.append(self.engine.submit(inp))
        except BaseException:
            close_all(streams)()
            raise
        return streams

    async def respond_when_done(
        self, request: Request, streams: list[RequestStream], body: Callable[[list[RequestOutput]], Any]
    ) -> Response:
        """The non-streamed answer: `body(final outputs)` as JSON once every request finished.

        If the client leaves first the requests are aborted (closing their streams) and the
        answer is 499, which nobody reads; it only marks the request in the access log.
        """
        try:
            outs = await until_disconnect(request, collect(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            close_all(streams)()
        self.check_prefill_outputs(outs)
        return JSONResponse(body(outs))
