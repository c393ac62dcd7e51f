"""What a client's JSON schema must pass before the grammar compiler sees it.

llguidance compiles a schema by recursion on the native stack, one frame group
per level of nesting, `$ref`s followed: a long enough chain or nesting overflows
the stack and the process dies with SIGSEGV, every other stream with it (llguidance
1.9; `engine.constraint` says what upstream knows of it). So a schema is measured here
first, without recursion (a schema nested past Python's own recursion limit is measured
as safely), and refused with a 400 that names the bound it passes. The compiler then
runs on a thread with a stack sized for these bounds with a wide margin
(`engine.constraint.DEEP_STACK`).

Also refused: what would make each token's mask costly or fail mid-reply
(`schema_costs`: long literals and patterns, counted repetitions that multiply,
many optional properties open at once), and a schema whose root admits no finite
value (a definition that only refers to itself, an object that requires a
property of its own type), which would otherwise pass the compiler and fail at
the first sampled tokens.

Invariants:
- No function here recurses. Every walk visits at most `MAX_NODES` subschemas
  (objects and booleans, `$ref` targets wherever they lie included) besides the
  document's JSON, whose nesting `MAX_NESTING` bounds; the fixpoint takes at most
  `MAX_PASSES` passes over them.
- Every local `$ref` ("#...": a JSON pointer, percent-encoded or not, or an
  `$anchor`) is resolved here or refused: what the compiler follows, the
  measures followed too.
- `check_schema` raises only `APIError(400)`; a schema it lets through may
  still be refused by the compiler (its own limits, its unsupported keywords).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from .api_errors import APIError
from .schema_costs import check_choices, check_literals

# Bounds, in schema levels and objects. tools/schema_bounds.py bisects the levels each
# construct takes to overflow a default 8 MiB stack; these stay far below the least of them.
MAX_DEPTH = 128  # schema levels along any path, `$ref`s followed
MAX_NESTING = 120  # JSON levels of the document: llguidance reads at most 128, its wrapper takes 5
MAX_NODES = 10_000  # subschemas (objects and booleans) in the document
MAX_PASSES = 64  # of the finite-value fixpoint; one unsettled by then is left to the compiler

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
    graph = _graph(schema, param)
    check_literals(graph.nodes.values(), param)
    depth, order = _depth(schema, graph)
    check_choices(graph.nodes, graph.refs, order, param)
    if depth > MAX_DEPTH:
        raise APIError(
            400,
            f"The JSON schema in '{param}' nests {depth} levels deep (following $ref), past "
            f"this server's limit of {MAX_DEPTH}. Flatten it or shorten its $ref chains.",
            param=param,
            code="schema_too_deep",
        )
    if not _finite(schema, graph, order):
        raise APIError(
            400,
            f"The JSON schema in '{param}' admits no finite value: nothing satisfies a part "
            "it requires, or its $ref recursion never ends (a definition that only refers to "
            "itself, or a required property of its own type). Make the recursive part "
            "optional or give it a base case.",
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


def walk_schema(schema: Any) -> Iterator[dict]:
    """Every schema object of the document reached through schema keywords (not `$ref`),
    each once."""
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            yield node
            stack.extend(_subschemas(node))


def ref_targets(schema: Any) -> dict[int, Any]:
    """Each schema object's local `$ref` target (a schema object or a boolean), by the id
    of the object that holds the `$ref`; for a schema `check_schema` let through."""
    return _graph(schema, "schema").refs


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


class _Graph:
    """The document's schema objects by id, and each one's `$ref` target (a schema object
    or a boolean)."""

    def __init__(self) -> None:
        self.nodes: dict[int, dict] = {}
        self.refs: dict[int, Any] = {}

    def edges(self, node: Any) -> list[Any]:
        out = list(_subschemas(node))
        if id(node) in self.refs:
            out.append(self.refs[id(node)])
        return out


def _graph(schema: Any, param: str) -> _Graph:
    """Every subschema reachable from the root, `$ref`s followed wherever they point, or a
    400 past `MAX_NODES` or for a local `$ref` that resolves to no schema."""
    anchors = _anchors(schema)
    graph, bools = _Graph(), 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            bools += 1
        elif isinstance(node, dict) and id(node) not in graph.nodes:
            graph.nodes[id(node)] = node
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                target = _target(schema, ref, anchors)
                if not isinstance(target, dict | bool):
                    raise APIError(
                        400,
                        f"The JSON schema in '{param}' has a $ref that points at no schema: "
                        f"{ref[:100]!r}.",
                        param=param,
                        code="unsupported_schema",
                    )
                graph.refs[id(node)] = target
                stack.append(target)
            stack.extend(_subschemas(node))
        else:
            continue
        if len(graph.nodes) + bools > MAX_NODES:
            raise APIError(
                400,
                f"The JSON schema in '{param}' has more than {MAX_NODES} subschemas, "
                "this server's limit.",
                param=param,
                code="schema_too_large",
            )
    return graph


def _anchors(doc: Any) -> dict[str, Any]:
    """`$anchor` names anywhere in the document (a "#name" reference points at one)."""
    found: dict[str, Any] = {}
    stack = [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("$anchor"), str):
                found.setdefault(value["$anchor"], value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def _target(root: Any, ref: str, anchors: dict[str, Any]) -> Any:
    """What a local `$ref` points at: a JSON pointer ("#", "#/$defs/a", percent-encoded or
    not) or an anchor ("#name"); None if nothing."""
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        return anchors.get(fragment)
    node = root
    for part in fragment.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and len(part) < 10:
            node = node[int(part)] if int(part) < len(node) else None
        else:
            return None
    return node


def _depth(schema: Any, graph: _Graph) -> tuple[int, list[int]]:
    """The most schema levels along a path from the root, `$ref`s followed (a `$ref` back
    onto the path, recursion, adds nothing: the compiler does not unroll it); and the
    schema objects in the order their walk finished, each after what it leads to."""
    depth: dict[int, int] = {}
    order: list[int] = []
    on_path: set[int] = {id(schema)}
    stack: list[tuple[Any, Iterator[Any]]] = [(schema, iter(graph.edges(schema)))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            below = [depth.get(id(c), 0) for c in graph.edges(node) if id(c) not in on_path]
            depth[id(node)] = 1 + max(below, default=0)
            order.append(id(node))
            continue
        if id(child) in depth or id(child) in on_path or not isinstance(child, dict):
            continue
        on_path.add(id(child))
        stack.append((child, iter(graph.edges(child))))
    return depth.get(id(schema), 1), order


FALSE = -1  # a dependency nothing satisfies (the `false` schema)


def _finite(schema: Any, graph: _Graph, order: list[int]) -> bool:
    """Whether the root admits a finite JSON value: the least fixpoint of "admits one",
    by passes over the schemas in walk order (each after what it leads to), from rules
    computed once. Not settled within `MAX_PASSES`: left to the compiler (True)."""
    if not isinstance(schema, dict):
        return schema is not False
    rules = {nid: _rule(graph.nodes[nid], graph) for nid in order}
    ok: set[int] = set()
    for _ in range(MAX_PASSES):
        grew = False
        for nid in order:
            if nid not in ok and _holds(rules[nid], ok):
                ok.add(nid)
                grew = True
        if id(schema) in ok or not grew:
            return id(schema) in ok
    return True


def _dep(s: Any) -> int | None:
    """A subschema as a dependency: its id, None if it always holds, FALSE if never."""
    if s is True:
        return None
    return FALSE if s is False else id(s)


def _deps(schemas: Any) -> list[int]:
    return [d for d in map(_dep, schemas) if d is not None]


def _rule(node: dict, graph: _Graph) -> tuple:
    """What `node` needs in order to admit a finite value: (schemas all needed, groups of
    which one each is needed, alternatives of which one is needed, each a list of schemas
    all needed; None: no alternative is required)."""
    need = _deps([graph.refs[id(node)]] if id(node) in graph.refs else [])
    if isinstance(node.get("allOf"), list):
        need += _deps(s for s in node["allOf"] if isinstance(s, dict | bool))
    groups = []
    for key in ("anyOf", "oneOf"):
        members = [s for s in node.get(key) or [] if isinstance(s, dict | bool)]
        if isinstance(node.get(key), list) and True not in members:  # `true` holds at once
            groups.append(_deps(members) or [FALSE])
    if "const" in node or "enum" in node:
        return need, groups, None
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None:
        return need, groups, None
    kinds = {t for t in types if isinstance(t, str)}
    if not kinds:  # no type named: the compiler judges
        return need, groups, None
    alternatives = [[]] if kinds & SCALARS else []
    if "object" in kinds:
        alternatives.append(_object_needs(node))
    if "array" in kinds:
        alternatives.append(_array_needs(node))
    return need, groups, alternatives


def _object_needs(node: dict) -> list[int]:
    """The schemas of an object's required properties, its `allOf` members' requirements
    on its own properties included (a `required` beside the `properties` it names)."""
    parts = [node, *(s for s in node.get("allOf") or [] if isinstance(s, dict))]
    props: dict[str, Any] = {}
    required: set[str] = set()
    for part in parts:
        if isinstance(part.get("properties"), dict):
            props.update(part["properties"])
        if isinstance(part.get("required"), list):
            required.update(name for name in part["required"] if isinstance(name, str))
    return _deps(props[name] for name in required if isinstance(props.get(name), dict | bool))


def _array_needs(node: dict) -> list[int]:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    prefix = [s for s in node.get("prefixItems") or [] if isinstance(s, dict | bool)]
    items = node.get("items", True) if isinstance(node.get("items", True), dict | bool) else True
    return _deps(prefix[:least] + ([items] if least > len(prefix) else []))


def _holds(rule: tuple, ok: set[int]) -> bool:
    need, groups, alternatives = rule
    if not all(d in ok for d in need):
        return False
    if not all(any(d in ok for d in group) for group in groups):
        return False
    return alternatives is None or any(all(d in ok for d in alt) for alt in alternatives)
