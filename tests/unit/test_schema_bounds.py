"""What a JSON schema must pass before the grammar compiler sees it, and the stack the
compiler runs on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from pydantic import BaseModel

from mlx_cache_server.serving.api_errors import APIError
from mlx_cache_server.serving.schema_bounds import MAX_DEPTH, MAX_NESTING, MAX_NODES, check_schema
from mlx_cache_server.serving.structured import forced_call_grammar, json_grammar, tool_call_schema


def chain(n: int, link=lambda ref: {"$ref": ref}) -> dict:
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def objects(ref: str) -> dict:
    return {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}


def nested(n: int, wrap) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = wrap(schema)
    return schema


def refused(schema, code: str) -> str:
    with pytest.raises(APIError) as e:
        check_schema(schema, "response_format")
    assert e.value.status == 400 and e.value.code == code
    return e.value.message


@pytest.mark.parametrize("n", [1_000, 10_000, 100_000])
def test_long_ref_chains_are_refused_naming_the_limit(n):
    code = "schema_too_deep" if n + 1 < MAX_NODES else "schema_too_large"
    message = refused(chain(n), code)
    assert str(MAX_DEPTH if code == "schema_too_deep" else MAX_NODES) in message


# The deepest of each construct the bounds admit: each compiles, on the deep stack.
WORST_ADMITTED = {
    "ref chain": chain(MAX_DEPTH - 2),
    "objects by ref": chain(MAX_DEPTH // 2 - 2, objects),
    "arrays by ref": chain(MAX_DEPTH // 2 - 2, lambda r: {"type": "array", "items": {"$ref": r}}),
    "anyOf by ref": chain(MAX_DEPTH // 2 - 2, lambda r: {"anyOf": [{"$ref": r}, {"type": "null"}]}),
    "nested arrays": nested(MAX_NESTING - 2, lambda s: {"type": "array", "items": s}),
    "wide anyOf": {"anyOf": [{"const": i} for i in range(MAX_NODES - 2)]},
}  # fmt: skip


@pytest.mark.parametrize("name", list(WORST_ADMITTED))
def test_the_worst_schemas_the_bounds_admit_compile(name):
    assert json_grammar(WORST_ADMITTED[name], "response_format")


@pytest.mark.parametrize(
    "schema",
    [
        chain(MAX_DEPTH),
        chain(MAX_DEPTH // 2 + 1, objects),
        nested(MAX_DEPTH + 1, lambda s: {"type": "array", "items": s}),
        nested(MAX_NESTING, lambda s: {"not": s}),
        {"const": nested(MAX_NESTING, lambda s: [s])},
    ],
    ids=["ref chain", "objects", "arrays", "JSON nesting", "a deep const"],
)
def test_one_level_past_a_bound_is_refused(schema):
    refused(schema, "schema_too_deep")


UNSATISFIABLE = {
    "itself": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "each other": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    },  # fmt: skip
    "a required self": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
    "a non-empty list of self": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "all of self and a string": {"allOf": [{"$ref": "#"}, {"type": "string"}]},
}
SATISFIABLE = {
    "an optional self": {"type": "object", "properties": {"n": {"$ref": "#"}}},
    "self or null": {
        "type": "object",
        "required": ["n"],
        "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    },  # fmt: skip
    "a tree": {
        "type": "object",
        "required": ["kids"],
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
    },  # fmt: skip
    "untyped with a required self": {"properties": {"n": {"$ref": "#"}}, "required": ["n"]},
    "a reference outside": {"$ref": "https://example.com/schema.json"},
}


@pytest.mark.parametrize("name", list(UNSATISFIABLE))
def test_recursion_that_never_ends_is_refused(name):
    refused(UNSATISFIABLE[name], "schema_unsatisfiable")


@pytest.mark.parametrize("name", list(SATISFIABLE))
def test_recursion_with_a_way_out_is_let_through(name):
    check_schema(SATISFIABLE[name], "response_format")


class Address(BaseModel):
    city: str


class Person(BaseModel):
    home: Address
    others: list[Address]
    work: Address | None = None


class Tree(BaseModel):
    value: int
    kids: list[Tree]


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("model", [Person, Tree])
def test_a_tools_own_refs_resolve_inside_the_call_schema(model):
    tools = [function("f", model.model_json_schema()), function("g", Person.model_json_schema())]
    schema = tool_call_schema(tools)
    assert set(schema["$defs"]) == {"tool0", "tool1"}
    refs = [s for s in _strings(schema) if s.startswith("#")]
    assert refs and all(
        r.startswith("#/$defs/tool0") or r.startswith("#/$defs/tool1") for r in refs
    )
    assert forced_call_grammar(tools)


def test_a_tool_without_refs_keeps_its_parameters_inline():
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = tool_call_schema(
        [{"type": "function", "function": {"name": "f", "parameters": params}}]
    )
    assert schema["properties"]["arguments"] == {**params, "additionalProperties": False}
    assert "$defs" not in schema


def test_a_tools_unsatisfiable_parameters_are_named():
    params = UNSATISFIABLE["a required self"]
    with pytest.raises(APIError) as e:
        tool_call_schema([function("f", params)])
    assert e.value.param == "tools[0].function.parameters"


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


DEEP = textwrap.dedent(
    """
    import os, sys, threading, llguidance
    from mlx_cache_server.engine.constraint import on_deep_stack
    n = 6000  # a chain past what an 8 MiB stack holds (tools/schema_bounds.py)
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"$defs": defs, "$ref": "#/$defs/d0"})
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    if sys.argv[1] == "deep":
        print(on_deep_stack(validate, grammar, None)[0])
    else:
        threading.stack_size(8 * 1024 * 1024)
        t = threading.Thread(target=validate, args=(grammar, None))
        t.start()
        t.join()
    sys.stdout.flush()
    os._exit(0)  # past native libraries' exit-time destructors, which are not the test
    """
)


@pytest.mark.parametrize("where", ["deep", "default"])
def test_compilation_runs_on_a_stack_that_holds_far_past_the_bounds(where):
    """The bounds are the first line; the deep stack is the second. A plain 8 MiB thread
    dies on this grammar (the control), `on_deep_stack` compiles it."""
    run = subprocess.run([sys.executable, "-c", DEEP, where], capture_output=True, text=True)
    if where == "deep":
        assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr[-500:]
    else:
        assert run.returncode < 0  # killed by SIGSEGV


def ref_chain(n: int, where: str = "x", quote: bool = False) -> dict:
    """A chain of $refs through a keyword no schema uses: what the compiler follows anyway."""
    key = "%24defs" if quote else "$defs"
    if where == "anchors":
        defs = {f"d{i}": {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"$anchor": f"a{n}", "type": "string"}
        return {"$defs": defs, "$ref": "#a0"}
    if where == "$defs":
        defs = {f"d{i}": {"$ref": f"#/{key}/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "string"}
        return {"$defs": defs, "$ref": f"#/{key}/d0"}
    return {"x": [{"$ref": f"#/x/{i + 1}"} for i in range(n)] + [{"type": "string"}],
            "$ref": "#/x/0"}  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "code"),
    [
        (ref_chain(24_000), "schema_too_large"),  # once SIGSEGV: the chain was not measured
        (ref_chain(3_000, "$defs", quote=True), "schema_too_deep"),  # percent-encoded
        (ref_chain(3_000, "anchors"), "schema_too_deep"),
        ({"type": "object", "properties": {f"p{i}": True for i in range(30_000)}},
         "schema_too_large"),  # once minutes of compiling
        ({"$ref": "#/nowhere"}, "unsupported_schema"),
        ({"$ref": "#nowhere"}, "unsupported_schema"),
        ({"anyOf": [{"type": "string"}], "properties": {"a": {"$ref": "#/anyOf/²"}}},
         "unsupported_schema"),  # once a 500: int("²")
        ({"anyOf": [{}], "properties": {"a": {"$ref": "#/anyOf/" + "0" * 5000}}},
         "unsupported_schema"),  # once a 500: past int()'s digits
        ({"type": "object", "properties": {"n": {"$ref": "#"}}, "allOf": [{"required": ["n"]}]},
         "schema_unsatisfiable"),  # once a 500 at the first token
        ({"anyOf": []}, "schema_unsatisfiable"),
    ],
    ids=["chain outside keywords", "percent-encoded chain", "anchor chain", "30,000 true",
         "pointer to nothing", "anchor to nothing", "superscript index", "5,000-digit index",
         "required in allOf", "empty anyOf"],
)  # fmt: skip
def test_what_the_review_found_is_a_400(schema, code):
    refused(schema, code)


def test_a_huge_required_list_is_read_once_as_the_properties_it_names():
    """The fixpoint re-checks a schema each time one it needs settles: its rule holds each
    required property once, however often `required` repeats it (once it re-read a
    500,000-name list on every check: minutes)."""
    from mlx_cache_server.serving.schema_bounds import _object_needs

    names = [f"p{i}" for i in range(3_000)]
    schema = {"type": "object", "properties": {n: {"type": "string"} for n in names},
              "required": [names[0]] * 500_000 + names}  # fmt: skip
    assert len(_object_needs(schema)) == 3_000
    check_schema(schema, "response_format")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": [{}]},  # once a 500: unhashable
        {"type": "object", "$defs": {"n": {"$anchor": "name", "type": "string"}},
         "properties": {"p": {"$ref": "#name"}}, "required": ["p"]},
        {"anyOf": [True, {"$ref": "#"}]},
    ],
    ids=["type list of objects", "an anchor", "anyOf with true"],
)  # fmt: skip
def test_schemas_the_review_found_refused_wrongly_are_let_through(schema):
    check_schema(schema, "response_format")


def test_a_tools_anchors_and_data_keep_their_meaning_in_the_call_schema():
    params = {"type": "object", "$defs": {"n": {"$anchor": "name", "type": "string"}},
              "properties": {"p": {"$ref": "#name"},
                             "kind": {"enum": [{"$ref": "#/components/User"}]},
                             "q": {"$ref": "#/$defs/n"}}}  # fmt: skip
    schema = tool_call_schema([function("f", params)])
    moved = schema["$defs"]["tool0"]["properties"]
    assert moved["p"]["$ref"] == "#name" and moved["q"]["$ref"] == "#/$defs/tool0/$defs/n"
    assert moved["kind"]["enum"] == [{"$ref": "#/components/User"}]  # data, not a pointer
    assert forced_call_grammar([function("f", params)])
