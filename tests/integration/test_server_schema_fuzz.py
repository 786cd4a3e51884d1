"""schemathesis over the server's own /openapi.json, in process, against a real engine on the
tiny model: no request the schema can describe (valid, or broken on purpose) gets a 5xx, every
answer is one the schema declares, and afterwards the server is healthy with every KV page free.

The request models are in the schema by hand (kvpipe/server/openapi_schema.py), so the bodies
are real /generate and OpenAI requests. A small context (64 tokens) keeps each generation short:
the whole module runs in about a minute on two cores.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.config import CacheConfig, RequestLimits, SchedulerConfig, ServerConfig
from kvpipe.server.http_server import create_app

# schemathesis comes with the `test` extra: without it this module is skipped, not failed, so
# what needs it is imported after the check
schemathesis = pytest.importorskip("schemathesis")

from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(600)

BODY_ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
MAX_EXAMPLES = {"/generate": 50, "/v1/completions": 40, "/v1/chat/completions": 40, "/abort_request": 15}
# every answer is declared: its status, its content type and, where given, its JSON schema
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# the request caps, small so the wire schema's negative cases (which /openapi.json spells as
# maxItems/maxLength) reach past each of them
CAPS = RequestLimits(
    max_prompts_per_request=4, max_stop_strings=3, max_stop_string_chars=8, max_stop_token_ids=4, max_field_size=16
)


def _servable_bodies(vocab: int, model: str) -> dict[str, dict]:
    """Request bodies the server should serve: the wire schemas narrowed to the ranges it accepts.

    The wire schemas say only "a number", "a list of ints": nearly every case built from them is
    refused with a 400 before the engine sees it. These narrowed copies make the fuzzer reach
    tokenisation, the scheduler, streaming and the KV pages too. Test-only: the served schema
    stays the plain wire model (the checks of protocol.py give the 400s their messages).
    """
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
        "minItems": 1,
        "maxItems": 20,
    }
    text = {"type": "string", "minLength": 1, "maxLength": 40}
    sampling = {
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": 40},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": CAPS.max_stop_string_chars},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": CAPS.max_stop_string_chars},
                    "maxItems": CAPS.max_stop_strings,
                },
            ]
        },
        "stop_token_ids": {**ids, "minItems": 0, "maxItems": CAPS.max_stop_token_ids},
        "ignore_eos": {"type": "boolean"},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        "skip_special_tokens": {"type": "boolean"},
        "no_stop_trim": {"type": "boolean"},
        "n": {"enum": [1, None]},
        "frequency_penalty": {"enum": [0, None]},
        "repetition_penalty": {"enum": [1, None]},
    }
    max_tokens = {"type": "integer", "minimum": 1, "maximum": 8}
    flags = {
        "stream": {"type": "boolean"},
        "rid": {"type": "string", "minLength": 1, "maxLength": 12},
        "cache_salt": {"type": "string", "maxLength": CAPS.max_field_size},
    }

    def obj(props: dict, required: list[str]) -> dict:
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    gen_common = {
        "sampling_params": obj({**sampling, "max_new_tokens": max_tokens}, []),
        "return_logprob": {"type": "boolean"},
        **flags,
    }
    openai_common = {
        **sampling,
        **flags,
        "max_tokens": max_tokens,
        "model": {"enum": [model, None]},
        "stream_options": obj({"include_usage": {"type": "boolean"}}, []),
    }
    # the chat template adds ~6 tokens a message, and a random character may take 4 byte-level
    # tokens: 2 messages of at most 6 characters stay inside the 64-token context
    content = {**text, "maxLength": 6}
    parts = {
        "type": "array",
        "items": obj({"type": {"enum": ["text"]}, "text": content}, ["type", "text"]),
        "maxItems": 1,
    }
    message = obj(
        {"role": {"enum": ["system", "user", "assistant"]}, "content": {"anyOf": [content, parts]}}, ["role", "content"]
    )
    return {
        "/generate": {
            "anyOf": [obj({"text": text, **gen_common}, ["text"]), obj({"input_ids": ids, **gen_common}, ["input_ids"])]
        },
        "/v1/completions": obj(
            {
                "prompt": {"anyOf": [text, ids]},
                "logprobs": {"enum": [0, None]},
                "echo": {"enum": [False]},
                **openai_common,
            },
            ["prompt"],
        ),
        "/v1/chat/completions": obj(
            {
                "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": 2},
                "logprobs": {"type": "boolean"},
                **openai_common,
            },
            ["messages"],
        ),
        "/abort_request": obj(
            {"rid": {"type": "string", "maxLength": CAPS.max_field_size}, "abort_all": {"type": "boolean"}}, []
        ),
    }


def _narrowed(doc: dict, bodies: dict[str, dict]) -> dict:
    doc = copy.deepcopy(doc)
    for path, schema in bodies.items():
        doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"] = schema
    return doc


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[TestClient, Any, Any]]:
    cfg = ServerConfig(
        model_path=str(tiny_model_dir),
        cache=CacheConfig(page_size=16, max_total_tokens=2048),
        scheduler=SchedulerConfig(context_length=64, max_running_requests=8),
        limits=CAPS,
        log_level="warning",
    )
    app = create_app(cfg)
    # raise_server_exceptions=False: a crash is a 500 the checks report with the request, not a
    # traceback out of the test client
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "engine did not load"
            time.sleep(0.1)
        limits = app.state.kvpipe.limits
        doc = app.openapi()
        servable = _narrowed(doc, _servable_bodies(limits.vocab_size, cfg.model_name))
        yield client, schemathesis.openapi.from_dict(doc), schemathesis.openapi.from_dict(servable)


def _whole_floats_as_ints(value: Any) -> Any:
    """schemathesis may spell an integer 8.0 (JSON Schema calls it an integer); the wire models
    are strict and refuse it with a 400 by design, so servable cases send 8."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _send(client: TestClient, case: Any, servable: bool) -> Any:
    kw = case.as_transport_kwargs(base_url="http://testserver")
    if "json" in kw:
        body = {"json": _whole_floats_as_ints(kw["json"]) if servable else kw["json"]}
    else:
        body = {"content": kw["data"]} if kw.get("data") else {}
    return client.request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"), **body)


def _fuzz(client: TestClient, operation: Any, max_examples: int, negative: bool = True) -> Counter[int]:
    """Run the checks on `max_examples` cases (valid ones, and broken ones with `negative`); the
    status tally."""
    statuses: Counter[int] = Counter()
    strategy = operation.as_strategy(GenerationMode.POSITIVE)
    if negative:
        strategy = st.one_of(strategy, operation.as_strategy(GenerationMode.NEGATIVE))

    # database=None: nothing written into the checkout; derandomize: CI sees the same cases
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        response = _send(client, case, servable=not negative)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    run()
    return statuses


def _wait_idle(client: TestClient, timeout_s: float = 30.0) -> dict:
    deadline, stats = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        stats = client.get("/server_info").json()["internal_states"][0]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["free_pages"] == stats["total_pages"]:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"KV pages leaked or requests stuck after fuzzing: {stats}")


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_body_route(served: tuple[TestClient, Any, Any], path: str) -> None:
    client, schema, servable = served
    statuses = _fuzz(client, schema[path]["POST"], MAX_EXAMPLES[path])
    served_statuses = _fuzz(client, servable[path]["POST"], MAX_EXAMPLES[path], negative=False)
    print(f"{path}: wire schema {dict(statuses)}, servable {dict(served_statuses)}")
    # the fuzzer reached the engine, not only the validation: most servable requests were served
    assert served_statuses[200] >= MAX_EXAMPLES[path] // 2, served_statuses
    _wait_idle(client)
    assert client.get("/health").status_code == 200


def test_info_routes(served: tuple[TestClient, Any, Any]) -> None:
    client, schema, _ = served
    ops = [op.ok() for op in schema.get_all_operations()]
    info = [op for op in ops if op.method.upper() == "GET"]
    assert len(info) >= 8  # health, server and model info (both spellings), metrics, models
    for op in info:
        _fuzz(client, op, 3)
    assert client.get("/health_generate").status_code == 200  # a real generation still works
    _wait_idle(client)


def test_the_schema_describes_the_bodies(served: tuple[TestClient, Any, Any]) -> None:
    """Without request bodies in the schema the fuzzer sends empty requests and finds nothing."""
    client, _, _ = served
    doc = client.get("/openapi.json").json()
    for path in BODY_ROUTES:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
    props = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    assert {"text", "input_ids", "sampling_params", "stream"} <= set(props)
    assert doc["components"]["schemas"]["CompletionRequest"]["required"] == ["prompt"]
    # the caps are in the schema, so the negative cases above went past them
    stop = doc["components"]["schemas"]["SamplingParamsIn"]["properties"]["stop"]["anyOf"]
    assert stop[1]["maxItems"] == CAPS.max_stop_strings and stop[1]["items"]["maxLength"] == CAPS.max_stop_string_chars
    assert props["text"]["anyOf"][1]["maxItems"] == CAPS.max_prompts_per_request
    # every other field has --max-field-size (issue 45): a message's role and name, a part's type
    message = doc["components"]["schemas"]["ChatMessage"]["properties"]
    assert message["role"]["maxLength"] == CAPS.max_field_size and message["name"]["anyOf"][0]["maxLength"] == 16
    part = doc["components"]["schemas"]["ContentPart"]["properties"]
    assert part["type"]["maxLength"] == 16 and part["text"]["anyOf"][0]["type"] == "string"  # typed, not Any
    assert props["cache_salt"]["anyOf"][0]["maxLength"] == CAPS.max_field_size
    assert {"401", "415", "503"} <= set(doc["paths"]["/generate"]["post"]["responses"])
