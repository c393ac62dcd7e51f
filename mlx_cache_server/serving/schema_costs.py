"""What makes a JSON schema's grammar costly at every token, bounded before it compiles.

llguidance compiles far more than it can follow at speed: a long `const` or
pattern makes every token's mask cost a batch step's time (the mask is computed
inside the step all streams share), and counted repetitions that multiply or a
union of objects with hundreds of optional properties compile, then fail at the
reply's second token on the engine's own limits. `schema_checks.check_schema`
runs these checks over every subschema it reaches; a custom tool's pattern is
checked by `pattern_problem` alone.

Invariants:
- Every check is linear in the schema's size and raises only `APIError(400)` with
  code `schema_too_large`, naming the bound.
- A repetition count is read with its digits bounded, never as an int of any length.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from .api_errors import APIError

MAX_LITERAL_CHARS = 10_000  # one `const`, `enum` value or `pattern`, as JSON text
MAX_LITERALS_CHARS = 100_000  # all of a document's `const`s, `enum`s and `pattern`s
MAX_OPTIONAL_PROPERTIES = 256  # properties not required, of one object or a union's at once
MAX_REPEAT = 10_000  # a pattern's counted repetitions ({n}), nested ones multiplied


def check_literals(nodes: Iterable[dict], param: str) -> None:
    """Refuse a schema whose literals or patterns pass their bounds."""
    total = 0
    for node in nodes:
        literals = [node["const"]] if "const" in node else []
        literals += node["enum"] if isinstance(node.get("enum"), list) else []
        for value in literals:
            size = len(json.dumps(value, ensure_ascii=False))
            total += size
            if size > MAX_LITERAL_CHARS:
                _too_large(param, f"a const or enum value of {size} characters, over "
                                  f"{MAX_LITERAL_CHARS}")  # fmt: skip
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            total += len(pattern)
            problem = pattern_problem(pattern)
            if problem:
                _too_large(param, problem)
        if total > MAX_LITERALS_CHARS:
            _too_large(param, f"consts, enums and patterns over {MAX_LITERALS_CHARS} characters")


def check_choices(nodes: dict[int, dict], refs: dict[int, Any], order: list[int],
                  param: str) -> None:  # fmt: skip
    """Refuse a schema where one value may take more than `MAX_OPTIONAL_PROPERTIES`
    optional properties at once: an object's own, and those of the objects a union
    (`anyOf`, `oneOf`) leaves open together, `$ref`s followed. The grammar engine weighs
    them all at the object's first token, and past its limits fails at the second."""
    choices: dict[int, int] = {}
    for nid in order:  # each after what it leads to; a recursion's way back counts nothing
        node = nodes[nid]
        count = _optional(node)
        members = [m for key in ("anyOf", "oneOf") for m in node.get(key) or []
                   if isinstance(m, dict)]  # fmt: skip
        members += [refs[nid]] if isinstance(refs.get(nid), dict) else []
        count += sum(choices.get(id(m), 0) for m in members)
        choices[nid] = count
        if count > MAX_OPTIONAL_PROPERTIES:
            _too_large(param, f"{count} optional properties open at once (an object's, or a "
                              f"union's objects'), over {MAX_OPTIONAL_PROPERTIES}")  # fmt: skip


def _optional(node: dict) -> int:
    if not isinstance(node.get("properties"), dict):
        return 0
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return len(set(node["properties"]) - {r for r in required if isinstance(r, str)})


def _too_large(param: str, what: str) -> None:
    raise APIError(
        400,
        f"The JSON schema in '{param}' has {what}, this server's limit.",
        param=param,
        code="schema_too_large",
    )


# Spaces allowed inside, as the `x` flag lets them be; a literal brace read as a count
# errs on the side of refusing.
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def pattern_problem(pattern: str) -> str | None:
    """What makes a regular expression (Rust's dialect) too costly to enforce, or None: its
    length, or its counted repetitions, nested ones multiplied (`(a{1000}){1000}` is a
    million). Unbounded ones (`*`, `+`, `{n,}` past n) are loops, which cost nothing."""
    if len(pattern) > MAX_LITERAL_CHARS:
        return f"a pattern of {len(pattern)} characters, over {MAX_LITERAL_CHARS}"
    repeats = _repeats(pattern)
    if repeats > MAX_REPEAT:
        return f"a pattern that repeats {repeats} times, over {MAX_REPEAT}"
    return None


def _repeats(pattern: str) -> int:
    """The largest product of nested counted repetitions in `pattern`."""
    groups = [1]  # for each open group, the largest count inside it so far
    last, at = 1, 0  # what the atom just read carries: a group's, what is inside it
    while at < len(pattern):
        c = pattern[at]
        count = _COUNT.match(pattern, at) if c == "{" else None
        if count is not None:
            digits = [d for d in count.groups() if d]
            n = max(int(d) if len(d) < 10 else 10**10 for d in digits)
            last *= max(n, 1)
            groups[-1] = max(groups[-1], last)
            at = count.end()
            continue
        if c == "(":
            groups.append(1)
        elif c == ")" and len(groups) > 1:
            last = groups.pop()
            groups[-1] = max(groups[-1], last)
            at += 1
            continue
        elif c == "[":
            at = _class_end(pattern, at)
        elif c == "\\":
            at += 1
        last = 1
        at += 1
    return max(groups)


def _class_end(pattern: str, at: int) -> int:
    """Where the character class opening at `at` ends (its `]`), nested classes included."""
    depth, at = 0, at
    while at < len(pattern):
        c = pattern[at]
        if c == "\\":
            at += 2
            continue
        if c == "[":
            depth += 1
            if pattern.startswith("]", at + 1) or pattern.startswith("^]", at + 1):
                at += 2 if pattern[at + 1] == "]" else 3  # a leading ']' is a member
                continue
        elif c == "]":
            depth -= 1
            if depth == 0:
                return at
        at += 1
    return at
