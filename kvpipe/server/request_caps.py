"""Which cap each field of a request body has, written into the wire models' JSON schemas.

One set of schemas serves twice: `/openapi.json` documents the caps (as maxLength / maxItems /
maxProperties, so a schema fuzzer tries the far side of each), and `body_check.check_body`
enforces them on the parsed JSON before anything expensive runs. The documented schema carries
the server's flags (`RequestLimits`); the enforced one also the model's own bounds (its context
length, and how many characters of prompt text could fit it), known once the engine has loaded.

The caps, by field:
- prompt text (`text`, `prompt`, a message's `content` and a text part's `text`): what could fit
  the context (`validation.prompt_chars_cap`); a chat's roles, names and texts also in total;
- token ids (`input_ids`, `prompt` as ids): the context length; messages and content parts: the
  context length (each one takes a token or more of it; content parts in total);
- `stop`, `stop_token_ids` and the per-prompt lists of a batch: their own flags;
- every other string, list or object (`role`, `name`, `rid`, `model`, `user`, `cache_salt`,
  `bootstrap_host`, `tools`, `logit_bias`, ...): `--max-field-size`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvpipe.config import RequestLimits
from kvpipe.server.body_check import COUNT, WHY, Budget
from kvpipe.server.openai_protocol import COMPLETION_BATCH_FIELDS, ChatCompletionRequest, CompletionRequest
from kvpipe.server.protocol import GENERATE_BATCH_FIELDS, AbortRequest, GenerateRequest
from kvpipe.server.validation import ModelLimits

REF = "#/components/schemas/{model}"
REQUEST_MODELS: tuple[type[BaseModel], ...] = (GenerateRequest, AbortRequest, CompletionRequest, ChatCompletionRequest)

# per-prompt list fields of each request model: with more entries than a batch may have prompts,
# the body is refused
BATCH_FIELDS = {
    "GenerateRequest": GENERATE_BATCH_FIELDS,
    "CompletionRequest": COMPLETION_BATCH_FIELDS,
    "ChatCompletionRequest": ("bootstrap_host", "bootstrap_port", "bootstrap_room"),
}
PROMPT_TEXT = {("GenerateRequest", "text"), ("CompletionRequest", "prompt"), ("ChatMessage", "content")}
PROMPT_TEXT.add(("ContentPart", "text"))
TOKEN_IDS = {("GenerateRequest", "input_ids"), ("CompletionRequest", "prompt")}
CHAT_CHARS = "chat_chars"  # budget: what the template prints of every message, in total
CHAT_PARTS = "chat_parts"  # budget: content parts of every message, in total
_CHAT_TEXT = {("ChatMessage", "role"), ("ChatMessage", "name"), ("ChatMessage", "content"), ("ContentPart", "text")}
_STOP_FIELDS = {"stop", "stop_token_ids"}


def request_defs(models: tuple[type[BaseModel], ...] = REQUEST_MODELS) -> dict[str, Any]:
    """The models' JSON schemas (and those they nest), by name, without caps."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    return dict(defs.get("$defs", {}))


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return prop.get("anyOf", [prop])


def _is_token_list(branch: dict[str, Any]) -> bool:
    """`[1, 2, 3]`: one prompt of token ids, not a batch."""
    return branch.get("type") == "array" and branch.get("items", {}).get("type") == "integer"


def _cap(node: dict[str, Any], key: str, cap: int, why: str) -> None:
    node[key], node[WHY] = cap, why


def _stop_caps(name: str, prop: dict[str, Any], limits: RequestLimits) -> None:
    chars = f"at most {limits.max_stop_string_chars} are allowed (--max-stop-string-chars)"
    for b in _branches(prop):
        if name == "stop" and b.get("type") == "string":
            _cap(b, "maxLength", limits.max_stop_string_chars, chars)
        elif name == "stop" and b.get("type") == "array":
            _cap(b, "maxItems", limits.max_stop_strings, f"at most {limits.max_stop_strings} (--max-stop-strings)")
            _cap(b["items"], "maxLength", limits.max_stop_string_chars, chars)
        elif b.get("type") == "array":
            _cap(
                b, "maxItems", limits.max_stop_token_ids, f"at most {limits.max_stop_token_ids} (--max-stop-token-ids)"
            )


def _batch_caps(prop: dict[str, Any], limits: RequestLimits) -> None:
    n = limits.max_prompts_per_request
    for b in _branches(prop):
        if b.get("type") == "array" and not _is_token_list(b):
            _cap(b, "maxItems", n, f"a request may batch at most {n} prompts (--max-prompts-per-request)")


def _model_caps(key: tuple[str, str], prop: dict[str, Any], model: ModelLimits) -> None:
    """The caps that follow from the model: its context length and the prompt text that fits it."""
    ctx, chars = model.context_length, model.max_prompt_chars
    fit = f"it cannot fit the model's context length of {ctx} tokens"
    tokens = f"the model's context length is {ctx} tokens"
    for b in _branches(prop):
        nested = b.get("items", {}) if b.get("type") == "array" else {}
        if key in PROMPT_TEXT and chars is not None:
            for s in (b, nested):
                if s.get("type") == "string":
                    _cap(s, "maxLength", chars, f"{fit} (a prompt of more than {chars} characters is not tokenized)")
        if key in TOKEN_IDS:
            for s in (b, nested):
                if _is_token_list(s):
                    _cap(s, "maxItems", ctx, tokens)
        if key == ("ChatCompletionRequest", "messages") and b.get("type") == "array":
            _cap(b, "maxItems", ctx, f"each takes at least one token of the model's context length of {ctx}")
        if key == ("ChatMessage", "content") and b.get("type") == "array":
            _cap(b, "maxItems", ctx, f"at most the model's context length, {ctx}")


def _field_size_caps(node: dict[str, Any], n: int) -> None:
    """`--max-field-size` on every string, list and object of `node` that has no cap yet."""
    why = f"at most {n} are allowed (--max-field-size)"
    for b in _branches(node):
        kind = b.get("type")
        if kind == "string" and "maxLength" not in b:
            _cap(b, "maxLength", n, why)
        elif kind == "array":
            if "maxItems" not in b:
                _cap(b, "maxItems", n, why)
            if isinstance(b.get("items"), dict) and "$ref" not in b["items"]:
                _field_size_caps(b["items"], n)
        elif kind == "object" and "additionalProperties" in b and "maxProperties" not in b:
            _cap(b, "maxProperties", n, why)


def apply_limits(defs: dict[str, Any], limits: RequestLimits, model: ModelLimits | None = None) -> None:
    """Write the caps into `defs` (from `request_defs`); with `model`, also the model's (without
    it, prompt text, token ids, messages and content parts stay uncapped: they depend on it)."""
    for name, schema in defs.items():
        for field, prop in schema.get("properties", {}).items():
            key = (name, field)
            if field in _STOP_FIELDS:
                _stop_caps(field, prop, limits)
            if field in BATCH_FIELDS.get(name, ()):
                _batch_caps(prop, limits)
            if model is not None:
                _model_caps(key, prop, model)
            if key in _CHAT_TEXT:
                for b in _branches(prop):
                    if b.get("type") in ("string", "array"):
                        b[COUNT] = CHAT_CHARS if b["type"] == "string" else CHAT_PARTS
            dynamic = key in PROMPT_TEXT or key in TOKEN_IDS or key == ("ChatCompletionRequest", "messages")
            if not dynamic:
                _field_size_caps(prop, limits.max_field_size)


def budgets(model: ModelLimits) -> dict[str, Budget]:
    """The totals over a chat: what its template prints, and its content parts."""
    ctx, chars = model.context_length, model.max_prompt_chars
    out = {
        CHAT_PARTS: Budget(
            ctx, f"the messages hold more than {ctx} content parts in all: at most the model's context length"
        )
    }
    if chars is not None:
        out[CHAT_CHARS] = Budget(
            chars,
            f"the messages have more than {chars} characters: it cannot fit the model's context length of {ctx} "
            f"tokens (a prompt of more than {chars} characters is not tokenized)",
        )
    return out
