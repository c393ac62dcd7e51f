"""A tool's parameters as closed objects: an argument object holds only the properties
its schema names.

JSON Schema lets an object carry properties its schema does not name unless it says
`additionalProperties: false`, and tools' schemas rarely say so. Under a grammar that
reads them literally a small model invents properties (`unit_type`, `description`,
...) until `max_tokens`, and the client gets no call. OpenAI's strict function calling
and vLLM's guided decoding read a tool's parameters as closed; so does this server,
for every call it enforces (forced calls, and `auto` under `prompted_tools`' lazy
grammar). `response_format` schemas are not touched: a reply's format is a document
the client describes, and JSON Schema's own reading of it is what OpenAI documents
for the non-strict json_schema format.

Invariants:
- An object schema that names its properties (`properties` or `patternProperties`,
  even empty) and says nothing of any other (`additionalProperties`,
  `unevaluatedProperties`) is closed, unless it requires a property it does not
  name (closed, it would admit nothing). So is the arguments' root when it is an
  object schema naming none and combining no other (no `allOf`, `anyOf`, `$ref`,
  ...): a function's arguments are the ones it declares.
- A nested object schema that names no properties (`{"type": "object"}`) is a
  free-form map: closing it would leave only `{}`, so it stays open.
- Where schemas that apply to one value together name properties, closing one would
  refuse what another names (an `allOf` of closed parts admits nothing): a schema,
  its `allOf` members and its `$ref` target, when more than one of them names
  properties, stay as written; so do a schema that names properties and those of its
  `anyOf`/`oneOf`/`then`/`else`/`dependentSchemas` members that name some too, and
  the condition of an `if` and the schema under a `not` (closing them changes what
  they rule out). What any of these refers to, along `$ref` chains, stays too.
- The input is not changed; its nesting is bounded (`check_schema` passed it).
"""

from __future__ import annotations

from typing import Any

from .schema_bounds import MANY, NAMED, ONE, ref_targets, walk_schema

OPENERS = ("additionalProperties", "unevaluatedProperties")
BRANCHES = ("anyOf", "oneOf", "then", "else")
# Keywords through which other schemas apply to the same value as the one holding them.
COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")


def closed(parameters: Any) -> Any:
    """A copy of a tool's `parameters` whose object schemas admit only what they name."""
    refs = ref_targets(parameters)
    kept = _kept_open(parameters, refs)
    return _closed(parameters, kept, root=True)


def _closed(schema: Any, kept: set[int], root: bool = False) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ONE:
        if isinstance(schema.get(key), dict):
            out[key] = _closed(schema[key], kept)
    for key in MANY + ("items",):
        if isinstance(schema.get(key), list):
            out[key] = [_closed(s, kept) for s in schema[key]]
    for key in NAMED:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed(s, kept) for name, s in schema[key].items()}
    if id(schema) not in kept and _closable(schema, root):
        out["additionalProperties"] = False
    return out


def _closable(schema: dict, root: bool) -> bool:
    if any(key in schema for key in OPENERS):
        return False
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if "patternProperties" not in schema and any(
        isinstance(name, str) and name not in named for name in required
    ):
        return False  # it requires a property it does not name: closing would admit nothing
    if _names_properties(schema):
        return True
    if any(key in schema for key in COMBINED):
        return False  # its properties may be named by what applies with it: left as written
    kinds = schema.get("type")
    return root and (kinds == "object" or isinstance(kinds, list) and "object" in kinds)


def _names_properties(schema: Any) -> bool:
    return isinstance(schema, dict) and ("properties" in schema or "patternProperties" in schema)


def _kept_open(schema: Any, refs: dict[int, Any]) -> set[int]:
    """The ids of the schema objects that apply to a value together with another that
    names properties of it (see the module's invariants), `$ref`s followed."""
    parts: list[Any] = []
    for node in walk_schema(schema):
        parts += [node[key] for key in ("if", "not") if isinstance(node.get(key), dict)]
        merged = _listed(node.get("allOf")) + ([refs[id(node)]] if id(node) in refs else [])
        named = [s for s in merged if _names_properties(refs.get(id(s), s))]
        named += [node] if _names_properties(node) else []
        if len(named) > 1:
            parts += named
        branches = [s for key in BRANCHES for s in _listed(node.get(key))]
        if isinstance(node.get("dependentSchemas"), dict):
            branches += _listed(list(node["dependentSchemas"].values()))
        named = [s for s in branches if _names_properties(refs.get(id(s), s))]
        if named and _names_properties(node):
            parts += [node, *named]
    kept: set[int] = set()
    while parts:  # each part, and what it refers to, along `$ref` chains
        part = parts.pop()
        if isinstance(part, dict) and id(part) not in kept:
            kept.add(id(part))
            if id(part) in refs:
                parts.append(refs[id(part)])
    return kept


def _listed(value: Any) -> list[Any]:
    """A keyword's schemas: a list's (`anyOf`), or the one schema (`then`)."""
    if isinstance(value, list):
        return [s for s in value if isinstance(s, dict)]
    return [value] if isinstance(value, dict) else []
