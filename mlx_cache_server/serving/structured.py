"""Structured output: OpenAI's `response_format` and forced tool calls as grammars.

A grammar is llguidance's; the engine enforces it token by token (see
`engine.constraint`). JSON is generated compact (no free whitespace), so a
model cannot wander off into blank lines inside an object. Schema features the
engine cannot enforce are a 400 naming them, never a silent fallback.
"""

from __future__ import annotations

from typing import Any

import llguidance

from ..engine.constraint import on_deep_stack
from .api_errors import APIError
from .closed_schema import closed
from .schema_bounds import MANY, NAMED, ONE, check_schema, walk_schema

COMPACT = {"whitespace_flexible": False}
# What chat templates' `tojson` writes (Python's json.dumps): a space after , and :.
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict[str, Any], param: str, options: dict = COMPACT) -> str:
    """A grammar for JSON that validates against `schema`, or a 400 naming what is wrong.

    With `"lenient": True` in `options` (tools' schemas), keywords the engine
    cannot enforce are left unenforced rather than refused."""
    check_schema(schema, param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"Invalid JSON schema in '{param}': {e}", param=param) from e
    return checked(grammar, param, strict=not options.get("lenient"))


def checked(grammar: str, param: str, strict: bool = True) -> str:
    """`grammar`, or a 400 saying what of it cannot be enforced (its warnings too, if
    `strict`)."""
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    error, messages = on_deep_stack(validate, grammar, None)
    if error or (messages and strict):
        # The compiler quotes the grammar around an error: the first line says what it is.
        said = "; ".join(m.strip().splitlines()[0][:300] for m in messages if m.strip())
        raise APIError(
            400,
            f"'{param}' uses what this server cannot enforce: {said}.",
            param=param,
            code="unsupported_schema",
        )
    return grammar


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar `response_format` asks for (None for text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema, a JSON schema.",
                param="response_format.json_schema.schema",
            )
        return json_grammar(schema, "response_format.json_schema.schema")
    raise APIError(
        400,
        f"Unknown response_format type {kind!r}: use text, json_object or json_schema.",
        param="response_format.type",
    )


def tool_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON for one call of one of `tools`: {"name": ..., "arguments": {...}}.

    The arguments are closed objects: only the properties a tool's schema names
    (`closed_schema`), as OpenAI's strict function calling reads them.
    A tool's parameters whose `$ref`s point into themselves ("#/$defs/Addr", as
    pydantic writes nested models, or "#" for a recursive one) are moved under the
    call schema's `$defs`, their pointers rewritten to lead there, so they resolve
    as they did at the parameters' root.
    """
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        check_schema(parameters, f"tools[{i}].function.parameters")
        parameters = closed(parameters)
        if _has_local_refs(parameters):
            home = f"#/$defs/tool{i}"
            defs[f"tool{i}"] = _rerooted(parameters, home)
            parameters = {"$ref": home}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": defs} if defs else schema


def _pointer(ref: Any) -> bool:
    """Whether a `$ref` is a JSON pointer into its document ("#", "#/..."); an anchor
    ("#name") names a schema wherever it is moved."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _has_local_refs(schema: Any) -> bool:
    return any(_pointer(node.get("$ref")) for node in walk_schema(schema))


def _rerooted(schema: Any, home: str) -> Any:
    """A copy of `schema` whose pointers lead into `home` instead of the root; values
    (`const`, `enum`, `default`) are left as they are, a "$ref" in them is data. `schema`
    has passed `check_schema`, so its nesting is bounded."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if _pointer(schema.get("$ref")):
        out["$ref"] = home + schema["$ref"][1:]
    for key in ONE:
        if isinstance(schema.get(key), dict):
            out[key] = _rerooted(schema[key], home)
    for key in MANY + ("items",):
        if isinstance(schema.get(key), list):
            out[key] = [_rerooted(s, home) for s in schema[key]]
    for key in NAMED:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _rerooted(s, home) for name, s in schema[key].items()}
    return out


def forced_call_grammar(tools: list[dict[str, Any]], options: dict = COMPACT) -> str:
    """A grammar for one call of one of `tools`, as JSON {"name", "arguments"}.

    Compact, it holds for any model, also one whose template knows no tools; for
    a template whose calls are this JSON between markers (hermes-style), the
    server writes the opening marker into the prompt and `options` follow the
    template's own JSON, so the call re-renders as the tokens generated. An
    agent's tools carry keywords the engine cannot enforce (`propertyNames`, say):
    those are left unenforced, the call still comes out.
    """
    return json_grammar(tool_call_schema(tools), "tools", {**options, "lenient": True})
