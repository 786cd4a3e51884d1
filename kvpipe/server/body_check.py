"""The cheap first look at a parsed JSON body: every field's type and size against the route's
wire schema with the server's caps written in (`request_caps.py`), before pydantic validation,
chat templates or tokenization see it.

Why not let pydantic refuse it: pydantic reports every bad item, so `input_ids: [1, "a", "a",
...]` of 2.5M entries cost 3 s of validation and a 300 MB error message; and a field typed
loosely (`content: list[dict]`) let a part's `text` of 2.5M integers through to the chat
template, which printed it and tokenized 17 MB of digits. Here the first problem ends the walk:
a size is compared before any item is looked at, and arrays of plain scalars are checked in one
tight loop. So the cost is bounded by the caps, not by the body.

The walker understands the JSON Schema subset pydantic writes for the wire models: `$ref`,
`anyOf`, `type`, `const`/`enum`, `properties` (unknown ones are ignored, as the models ignore
them), `additionalProperties`, `items`, `maxLength`/`maxItems`/`maxProperties`, plus two
keywords of its own: `x-kvpipe-why` (the error's tail that says which cap, e.g. a flag) and
`x-kvpipe-count` (a total over the whole body: the characters of every chat message together,
checked against `Budget`s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpipe.server.errors import APIError

WHY = "x-kvpipe-why"
COUNT = "x-kvpipe-count"
_REF_PREFIX = "#/components/schemas/"

# JSON Schema type -> the Python types json.loads gives for it (bool is not a number in JSON)
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}
_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}


@dataclass(frozen=True)
class Budget:
    """A total over the body (`x-kvpipe-count: name` adds a string's length or a list's entries)."""

    cap: int
    message: str  # the error past the cap


def _json_type_ok(value: Any, name: str) -> bool:
    if type(value) is bool:
        return name == "boolean"
    return isinstance(value, _TYPES[name])


def _plain_test(kind: str, cap: int | None) -> Callable[[Any], bool]:
    """Whether a value is of a plain JSON type (json.loads makes exact types: no subclasses but
    bool's of int), within `cap` characters for a string."""
    if kind == "string":
        return (lambda v: type(v) is str) if cap is None else (lambda v: type(v) is str and len(v) <= cap)
    exact = {"integer": (int,), "number": (int, float), "boolean": (bool,)}[kind]
    return lambda v: type(v) in exact


def _describe(value: Any) -> str:
    return "null" if value is None else _NAMES.get(type(value), type(value).__name__)


def _expected(schema: Mapping[str, Any]) -> str:
    names = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean"}
    names.update(null="null", array="a list", object="an object")
    return names.get(schema.get("type", ""), "a value")


class _Walk:
    def __init__(self, defs: Mapping[str, Any], budgets: Mapping[str, Budget]) -> None:
        self.defs, self.budgets = defs, budgets
        self.totals: dict[str, int] = {}

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        while "$ref" in schema:
            schema = self.defs[schema["$ref"].removeprefix(_REF_PREFIX)]
        return schema

    def fail(self, where: str, message: str) -> APIError:
        return APIError(f"{where or 'the body'} {message}", param=where or None)

    def count(self, schema: Mapping[str, Any], n: int) -> None:
        name = schema.get(COUNT)
        if name is None or name not in self.budgets:
            return
        total = self.totals[name] = self.totals.get(name, 0) + n
        budget = self.budgets[name]
        if total > budget.cap:
            raise APIError(budget.message, param=name)

    def check(self, value: Any, schema: Mapping[str, Any], where: str) -> None:
        schema = self.resolve(schema)
        if "anyOf" in schema:
            return self.any_of(value, schema["anyOf"], where)
        kind = schema.get("type")
        if kind is not None and not _json_type_ok(value, kind):
            raise self.fail(where, f"must be {_expected(schema)}, not {_describe(value)}")
        if "const" in schema and value != schema["const"]:
            raise self.fail(where, f"must be {schema['const']!r}")
        if "enum" in schema and value not in schema["enum"]:
            raise self.fail(where, f"must be one of {schema['enum']}")
        if isinstance(value, str):
            self.sized(schema, len(value), where, "has", "characters")
        elif isinstance(value, list):
            self.sized(schema, len(value), where, "holds", "entries")
            self.items(value, schema.get("items"), where)
        elif isinstance(value, dict):
            self.obj(value, schema, where)
        return None

    def sized(self, schema: Mapping[str, Any], n: int, where: str, verb: str, unit: str) -> None:
        cap = schema.get("maxLength" if unit == "characters" else "maxItems")
        if cap is not None and n > cap:
            raise self.fail(where, f"{verb} {n} {unit}: {schema.get(WHY) or f'at most {cap} are allowed'}")
        self.count(schema, n)

    def items(self, value: list[Any], schema: Mapping[str, Any] | None, where: str) -> None:
        if schema is None:
            return
        schema = self.resolve(schema)
        kind: str = schema.get("type", "")
        plain = kind in ("integer", "number", "boolean", "string") and not ({"anyOf", "const", "enum"} & schema.keys())
        if plain:  # one tight loop: a list of 100k token ids is checked in milliseconds
            if not all(map(_plain_test(kind, schema.get("maxLength")), value)):
                for i, v in enumerate(value):  # the first that failed, with its message
                    self.check(v, schema, f"{where}.{i}")
            if COUNT in schema:
                for v in value:
                    self.count(schema, len(v))
            return None
        for i, v in enumerate(value):
            self.check(v, schema, f"{where}.{i}")
        return None

    def obj(self, value: dict[str, Any], schema: Mapping[str, Any], where: str) -> None:
        cap = schema.get("maxProperties")
        if cap is not None and len(value) > cap:
            raise self.fail(where, f"holds {len(value)} entries: {schema.get(WHY) or f'at most {cap} are allowed'}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, v in value.items():
            sub = props.get(key)
            if sub is None and isinstance(extra, dict):
                sub = extra
            if sub is not None:
                self.check(v, sub, f"{where}.{key}" if where else key)

    def any_of(self, value: Any, branches: list[Mapping[str, Any]], where: str) -> None:
        """The first branch that takes the value; else the error of the branch meant (its type
        matches, and for a list, its items' type matches the first entry's)."""
        resolved = [self.resolve(b) for b in branches]
        fitting = [b for b in resolved if "type" not in b or _json_type_ok(value, b["type"])]
        if not fitting:
            kinds = " or ".join(_expected(b) for b in resolved)
            raise self.fail(where, f"must be {kinds}, not {_describe(value)}")
        if isinstance(value, list) and value and len(fitting) > 1:
            fitting.sort(key=lambda b: not self._items_take(b, value[0]))
        first: APIError | None = None
        for b in fitting:
            totals = dict(self.totals)
            try:
                return self.check(value, b, where)
            except APIError as e:  # an error of a later branch says less
                first = first or e
                self.totals = totals  # a branch that failed counts nothing
        assert first is not None
        raise first

    def _items_take(self, branch: Mapping[str, Any], item: Any) -> bool:
        items = branch.get("items")
        if items is None:
            return True
        items = self.resolve(items)
        kinds = [self.resolve(b).get("type") for b in items.get("anyOf", [items])]
        return any(k is None or _json_type_ok(item, k) for k in kinds)


def check_body(body: Any, model: str, defs: Mapping[str, Any], budgets: Mapping[str, Budget] | None = None) -> None:
    """Raise a 400 APIError at the first field of `body` whose type or size the schema of
    `model` (a name in `defs`) refuses; what passes is safe to hand to pydantic."""
    _Walk(defs, budgets or {}).check(body, {"$ref": _REF_PREFIX + model}, "")
