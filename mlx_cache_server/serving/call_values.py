"""Argument values as two call formats write them back, for `call_markup`'s grammars.

- Gemma 4's template writes a call's arguments with its `format_argument` macro:
  strings between `<|"|>` tokens, as they are; booleans `true`/`false`; numbers as
  Python prints them; objects `{key:value,...}` with bare keys in the order Jinja's
  `dictsort` gives (case-insensitive), at every level; lists `[a,b]`.
- Python call syntax (pythonic, LFM2.5's) is written back by `call_history.pythonic`:
  `key=value` with each value as `json.dumps` writes it.

Both read a float back as a Python float and print it as Python does (`repr`). A
number written otherwise (`1.50`, `1e2`, `-0`) reads back as the same value but is
printed differently next turn, so reuse would stop there: a number is generated as
Python prints it, within the digits a float keeps (at most 15 significant ones, an
exponent in Python's plain range).

Invariants:
- A grammar here admits only text that the template (or `call_history`) writes back
  unchanged for the value it reads as, except where a schema leaves a value's shape
  open (a free-form map: Gemma's template sorts its keys, which the model writes in
  any order).
- Gemma strings hold no `<` (its string marker and every other marker of its
  vocabulary start with one: text holding one would not re-tokenize as generated)
  and no NUL (its parser's placeholders).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PY_INTEGER = r"/0|-?[1-9][0-9]*/"  # as Python prints an int
# An int, or a float as Python prints it: 15 significant digits at most, no exponent.
_DECIMAL = r"[1-9][0-9]{0,6}\.(0|[0-9]{0,7}[1-9])"  # 1.0, 12.25
_FRACTION = r"0\.(0|0{0,3}[1-9]([0-9]{0,6}[1-9])?)"  # 0.0, 0.0001, 0.125
PY_NUMBER = "/0|-?([1-9][0-9]*|" + _DECIMAL + "|" + _FRACTION + ")/"
# Numbers as Python prints them and booleans as JSON writes them: how both formats'
# write-backs print a non-string scalar.
SCALARS = {"integer": PY_INTEGER, "number": PY_NUMBER, "boolean": '("true" | "false")'}
# A string as json.dumps(ensure_ascii=False) writes it.
PY_STRING = r'/"([^"\\\x00-\x1f]|\\["\\bfnrt]|\\u00(0[0-7]|0b|0e|0f|1[0-9a-f]))*"/'
GEMMA_TEXT = r"/[^<\x00]*/"
GEMMA_QUOTE = '<|"|>'
GENERIC = "gemma_value"


def literal(text: str) -> str:
    """A Lark string for `text`."""
    return json.dumps(text, ensure_ascii=False)


def choice(alternatives: list[str]) -> str:
    return "(" + " | ".join(alternatives) + ")"


class Rules:
    """Named Lark rules a grammar's expressions refer to, in the order they were made."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.lines = prefix, []

    def add(self, body: str) -> str:
        name = f"{self.prefix}_{len(self.lines)}"
        self.lines.append(f"{name}: {body}\n")
        return name

    def text(self) -> str:
        return "".join(self.lines)

    def listed(self, items: list[tuple[str, bool]], sep: str) -> str:
        """Lark for `items` (an expression each, and whether it must be there) in order,
        those present separated by `sep`; "" for none. Rules per item, not a choice of
        each first item written out, so the grammar grows as the items do."""
        rest, first = "", ""  # the items after this one: each after a `sep`; the first bare
        for expr, required in reversed(items):
            optional = "" if required else "?"
            this = f"{expr} {rest}".strip()
            if required:
                first = self.add(this)
            elif first:
                first = self.add(f"{this} | {first}")
            else:
                first = self.add(f"({this})?")
            rest = self.add(f"({literal(sep)} {expr}){optional} {rest}".strip())
        return first


def _kinds(prop: dict[str, Any]) -> list[str]:
    kind = prop.get("type")
    return [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)]


class GemmaValues:
    """Values in Gemma 4's `format_argument` syntax, held to their schemas: the
    rules they need gather here (`rules.text()` ends the grammar). FunctionGemma's
    template writes the same syntax, its strings between `<escape>` tokens (`quote`),
    and its parser ends a call at the first `}` (`text` holds none)."""

    def __init__(
        self, marker: Callable[[str], str], quote: str = GEMMA_QUOTE, text: str = GEMMA_TEXT
    ) -> None:
        self.marker, self.rules, self.generic = marker, Rules("gemma"), False
        self.quote, self.text_regex = quote, text

    def fields(self, schema: dict[str, Any]) -> str:
        """An object's `key:value` pairs, comma-separated, keys in `dictsort` order."""
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        items = [
            (f"{literal(name + ':')} {self.value(prop)}", name in required)
            for name, prop in sorted(props.items(), key=lambda kv: kv[0].lower())
        ]
        return self.rules.listed(items, ",")

    def value(self, prop: Any) -> str:
        prop = prop if isinstance(prop, dict) else {}
        choices = [prop["const"]] if "const" in prop else prop.get("enum")
        if isinstance(choices, list):
            written = [self.literal(c) for c in choices if c is not None]
            return choice(written) if written else self.any()
        branches = prop.get("anyOf") or prop.get("oneOf")
        if isinstance(branches, list) and branches:
            return choice([self.value(b) for b in branches])
        kinds = [k for k in _kinds(prop) if k != "null"]  # None is written as no value
        if not kinds:
            return self.any()
        return choice([self.typed(kind, prop) for kind in kinds])

    def typed(self, kind: str, prop: dict[str, Any]) -> str:
        if kind == "string":
            return self.string(self.text_regex)
        if kind in SCALARS:
            return SCALARS[kind]
        if kind == "object" and isinstance(prop.get("properties"), dict):
            return f'"{{" {self.fields(prop)} "}}"'
        if kind == "array" and isinstance(prop.get("items"), dict):
            item = self.value(prop["items"])
            return f'"[" ({item} ("," {item})*)? "]"'
        return self.any()

    def string(self, text: str) -> str:
        quote = self.marker(self.quote)
        return f"{quote} {text} {quote}"

    def literal(self, value: Any) -> str:
        """`value` as `format_argument` writes it (keys in `dictsort` order)."""
        if isinstance(value, str):
            return self.string(literal(value))
        if isinstance(value, bool):
            return literal("true" if value else "false")
        if isinstance(value, dict):
            pairs = sorted(value.items(), key=lambda kv: str(kv[0]).lower())
            inner = ' "," '.join(f"{literal(str(k) + ':')} {self.literal(v)}" for k, v in pairs)
            return f'"{{" {inner} "}}"'
        if isinstance(value, list):
            inner = ' "," '.join(self.literal(v) for v in value)
            return f'"[" {inner} "]"'
        return literal(str(value))

    def any(self) -> str:
        """Any value the template writes, where the schema leaves its shape open."""
        self.generic = True
        return GENERIC

    def text(self) -> str:
        """The named rules the values refer to."""
        if not self.generic:
            return self.rules.text()
        pair = f'/[A-Za-z0-9_]+/ ":" {GENERIC}'
        return self.rules.text() + (
            f'{GENERIC}: {self.string(self.text_regex)} | {PY_NUMBER} | "true" | "false"'
            f' | "{{" ({pair} ("," {pair})*)? "}}"'
            f' | "[" ({GENERIC} ("," {GENERIC})*)? "]"\n'
        )


def python_scalar(prop: dict[str, Any]) -> str | None:
    """A value of `prop` as `json.dumps` writes it, where it is a scalar (else None)."""
    choices = [prop["const"]] if "const" in prop else prop.get("enum")
    if isinstance(choices, list) and choices:
        return choice([literal(json.dumps(c, ensure_ascii=False)) for c in choices])
    kind = prop.get("type")
    if not isinstance(kind, str):  # a list of types, or none: no one scalar
        return None
    return PY_STRING if kind == "string" else SCALARS.get(kind)


# What a format's own value syntax holds a value to: its type, a string enum, an object's
# named properties. Keywords past that (bounds, patterns, `$ref`s, unions) it would drop,
# and its parser would read some values otherwise than written (a union's JSON string,
# its quotes kept): a tool using any is forced as the server's bare JSON call instead.
UNENFORCED = frozenset({
    "pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "uniqueItems", "contains",
    "prefixItems", "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "$ref", "$defs", "definitions", "anyOf", "oneOf",
    "allOf", "not", "if", "then", "else",
})  # fmt: skip


def plain_parameters(tool: dict[str, Any], nested: bool) -> bool:
    """Whether a tool's parameters are an object of values a format's own syntax holds
    whole: scalars and string enums, and with `nested` objects and lists of those too."""
    function = tool.get("function") if isinstance(tool, dict) else None
    schema = function.get("parameters") if isinstance(function, dict) else None
    return _plain_object(schema or {"type": "object", "properties": {}}, nested)


def _plain_object(schema: Any, nested: bool) -> bool:
    if not isinstance(schema, dict) or UNENFORCED & schema.keys():
        return False
    props, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return False
    return all(isinstance(r, str) for r in required) and all(
        _plain_value(p, nested) for p in props.values()
    )


def _plain_value(prop: Any, nested: bool) -> bool:
    if not isinstance(prop, dict) or UNENFORCED & prop.keys():
        return False
    if "const" in prop or "enum" in prop:
        choices = [prop["const"]] if "const" in prop else prop["enum"]
        return (
            isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices)
        )
    kind = prop.get("type")
    if kind in ("string", "integer", "number", "boolean"):
        return True
    if nested and kind == "object":
        return _plain_object(prop, nested)
    if nested and kind == "array":
        return _plain_value(prop.get("items"), nested)
    return False
