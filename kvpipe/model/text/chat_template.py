"""Render HF chat templates the way transformers does: a sandboxed, immutable jinja2 environment
with trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson`
that does not HTML-escape. Templates come from model directories and are untrusted code.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flatten OpenAI-style content parts ([{"type": "text", "text": ...}]) into one string."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"unsupported message content part {kind!r}: only text parts are supported")
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "".join(texts)}
        elif content is None:
            m = {**m, "content": ""}
        out.append(m)
    return out


def render_chat(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **special_tokens: Any) -> str:
    return compile_template(source).render(
        messages=normalize_messages(messages), add_generation_prompt=add_generation_prompt, **special_tokens
    )
