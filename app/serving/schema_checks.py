"""What a client's JSON schema must pass before the grammar compiler sees it.

llguidance compiles a schema by recursion on the native stack, one frame group
per level of nesting, `$ref`s followed: a long enough chain or nesting overflows
the stack and the process dies with SIGSEGV, every other stream with it. So a
schema is measured here first, without recursion (a schema nested past Python's
own recursion limit is measured as safely), and refused with a 400 that names
the bound it passes. The compiler then runs on a thread with a stack sized for
these bounds with a wide margin (`engine.constraint.DEEP_STACK`).

Also refused: a schema whose root admits no finite value (a definition that
only refers to itself, an object that requires a property of its own type),
which would otherwise pass the compiler and fail at the first sampled tokens.

Invariants:
- No function here recurses; every walk is bounded by `MAX_NODES`.
- `check_schema` raises only `APIError(400)`; a schema it lets through may
  still be refused by the compiler (its own limits, its unsupported keywords).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .errors import APIError

# Bounds, in schema levels and objects. bench/schema_bounds.py bisects the levels each
# construct takes to overflow a default 8 MiB stack; these stay far below the least of them.
MAX_DEPTH = 128  # schema levels along any path, `$ref`s followed
MAX_NESTING = 120  # JSON levels of the document: llguidance reads at most 128, its wrapper takes 5
MAX_NODES = 10_000  # schema objects in the document

# Keywords whose value is one schema, a list of schemas, or a name -> schema mapping.
ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
       "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")  # fmt: skip
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCALARS = {"string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, param: str) -> None:
    """Refuse `schema` with a 400 naming the bound it passes, or the reason it admits
    no finite value; return quietly for anything the grammar compiler may judge."""
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"'{param}' must be a JSON schema (an object).", param=param)
    _check_nesting(schema, param)
    nodes = _nodes(schema, param)
    refs = _refs(schema, nodes)
    depth = _depth(schema, refs)
    if depth > MAX_DEPTH:
        raise APIError(
            400,
            f"The JSON schema in '{param}' nests {depth} levels deep (following $ref), past "
            f"this server's limit of {MAX_DEPTH}. Flatten it or shorten its $ref chains.",
            param=param,
            code="schema_too_deep",
        )
    if not _finite(schema, nodes, refs):
        raise APIError(
            400,
            f"The JSON schema in '{param}' admits no finite value: its $ref recursion "
            "never ends (a definition that only refers to itself, or a required property "
            "of its own type). Make the recursive part optional or give it a base case.",
            param=param,
            code="schema_unsatisfiable",
        )


def _check_nesting(doc: Any, param: str) -> None:
    stack = [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if level > MAX_NESTING:
            raise APIError(
                400,
                f"The JSON schema in '{param}' nests past {MAX_NESTING} JSON levels, "
                "this server's limit.",
                param=param,
                code="schema_too_deep",
            )
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict | list):
            stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))


def _subschemas(node: Any) -> Iterator[Any]:
    if not isinstance(node, dict):
        return
    for key in ONE:
        if isinstance(node.get(key), dict | bool):
            yield node[key]
    for key in MANY + ("items",):
        if isinstance(node.get(key), list):
            yield from (s for s in node[key] if isinstance(s, dict | bool))
    for key in NAMED:
        if isinstance(node.get(key), dict):
            yield from (s for s in node[key].values() if isinstance(s, dict | bool))


def _nodes(schema: Any, param: str) -> dict[int, Any]:
    """Every schema object in the document by id, or a 400 past `MAX_NODES`."""
    seen: dict[int, Any] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, dict):
            continue
        seen[id(node)] = node
        if len(seen) > MAX_NODES:
            raise APIError(
                400,
                f"The JSON schema in '{param}' has more than {MAX_NODES} subschemas, "
                "this server's limit.",
                param=param,
                code="schema_too_large",
            )
        stack.extend(_subschemas(node))
    return seen


def _target(root: Any, ref: Any) -> Any:
    """What a local `$ref` ("#", "#/$defs/a", any JSON pointer) points at; None if it is
    not local or points nowhere (the compiler reports those)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(schema: Any, nodes: dict[int, Any]) -> dict[int, Any]:
    """Each schema's `$ref` target, where that is a schema of the document."""
    refs = {}
    for node in nodes.values():
        target = _target(schema, node.get("$ref"))
        if id(target) in nodes or isinstance(target, bool):
            refs[id(node)] = target
    return refs


def _edges(node: Any, refs: dict[int, Any]) -> list[Any]:
    out = list(_subschemas(node))
    target = refs.get(id(node))
    if isinstance(target, dict):
        out.append(target)
    return out


def _depth(schema: Any, refs: dict[int, Any]) -> int:
    """The most schema levels along a path from the root, `$ref`s followed; a `$ref` back
    onto the path (recursion) adds nothing, as the compiler does not unroll it."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, Iterator[Any]]] = [(schema, iter(_edges(schema, refs)))]
    on_path.add(id(schema))
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            below = [depth.get(id(c), 0) for c in _edges(node, refs) if id(c) not in on_path]
            depth[id(node)] = 1 + max(below, default=0)
            continue
        if id(child) in depth or id(child) in on_path or not isinstance(child, dict):
            continue
        on_path.add(id(child))
        stack.append((child, iter(_edges(child, refs))))
    return depth.get(id(schema), 1)


def _finite(schema: Any, nodes: dict[int, Any], refs: dict[int, Any]) -> bool:
    """Whether the root admits a finite JSON value: the least fixpoint of "admits one",
    found by propagating from the schemas that admit one outright."""
    ok: set[int] = set()
    users: dict[int, list[Any]] = {}
    for node in nodes.values():
        for dep in _edges(node, refs):
            users.setdefault(id(dep), []).append(node)
    work = [node for node in nodes.values() if _admits(node, ok, refs)]
    while work:
        node = work.pop()
        if id(node) in ok:
            continue
        ok.add(id(node))
        work.extend(u for u in users.get(id(node), ()) if id(u) not in ok and _admits(u, ok, refs))
    return id(schema) in ok if isinstance(schema, dict) else schema is not False


def _admits(node: Any, ok: set[int], refs: dict[int, Any]) -> bool:
    """Whether `node` admits a finite value, given the schemas `ok` already known to."""

    def good(s: Any) -> bool:
        return s is True or (isinstance(s, dict) and id(s) in ok)

    if not isinstance(node, dict):
        return node is not False
    target = refs.get(id(node))
    if id(node) in refs and not good(target):
        return False
    if isinstance(node.get("allOf"), list) and not all(map(good, node["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(map(good, node[key])):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if types is None or types & SCALARS:
        return True
    if "object" in types:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if all(good(props[name]) for name in required if isinstance(name, str) and name in props):
            return True
    if "array" in types:
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items", True)
        slots = [
            prefix[i] if i < len(prefix) else items for i in range(min(least, len(prefix) + 1))
        ]
        if all(good(s) if isinstance(s, dict | bool) else True for s in slots):
            return True
    return False
