"""A tool's arguments are closed objects: only the properties its schema names, unless
the schema opens them; `response_format` keeps JSON Schema's open objects."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest
from pydantic import BaseModel
from transformers import PreTrainedTokenizerFast

from mlx_cache_server.serving.closed_schema import closed
from mlx_cache_server.serving.structured import forced_call_grammar, json_grammar, tool_call_schema
from tests.tiny_model import build_tokenizer
from tests.unit.test_prompted_tools import Driver

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
           "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}  # fmt: skip
CALL = '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"'


def tool(parameters: dict | None, name: str = "get_weather") -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


@pytest.fixture(scope="module")
def tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=0)


def test_a_forced_call_admits_only_the_declared_properties(tokenizer):
    run = Driver(tokenizer, forced_call_grammar([tool(WEATHER)]))
    run.write(CALL)
    assert not run.allows(",") and run.allows("}")
    run.write("}}")
    assert run.allowed == {0}  # the call is whole: only the end


def test_a_schema_that_opens_its_object_keeps_it_open(tokenizer):
    for opened in (True, {"type": "string"}):
        run = Driver(
            tokenizer, forced_call_grammar([tool({**WEATHER, "additionalProperties": opened})])
        )
        run.write(CALL)
        assert run.allows(",") and run.allows("}")


def test_response_format_keeps_json_schemas_open_objects(tokenizer):
    run = Driver(tokenizer, json_grammar(WEATHER, "response_format"))
    run.write('{"city":"Paris","unit":"c"')
    assert run.allows(",")


def test_nested_objects_that_name_properties_are_closed_free_form_maps_stay_open():
    address = {"type": "object", "properties": {"street": {"type": "string"}}}
    params = {"type": "object", "properties": {
        "home": address, "tags": {"type": "object"},
        "many": {"type": "array", "items": address},
        "either": {"anyOf": [address, {"type": "null"}]},
        "extra": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
    }}  # fmt: skip
    out = closed(params)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["home"]["additionalProperties"] is False
    assert props["many"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["tags"]  # names none: a free-form map
    assert props["extra"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in params and "additionalProperties" not in address


def test_the_arguments_root_is_closed_even_when_it_names_no_properties(tokenizer):
    for parameters in (None, {"type": "object"}):
        run = Driver(tokenizer, forced_call_grammar([tool(parameters)]))
        run.write('{"name":"get_weather","arguments":{')
        assert run.allows("}") and not run.allows('"')


class Address(BaseModel):
    city: str


class Person(BaseModel):
    home: Address
    work: Address | None = None


def test_a_pydantic_models_definitions_are_closed():
    schema = tool_call_schema([tool(Person.model_json_schema())])
    assert schema["$defs"]["tool0"]["additionalProperties"] is False
    assert schema["$defs"]["tool0"]["$defs"]["Address"]["additionalProperties"] is False


def test_parts_that_apply_together_stay_as_written(tokenizer):
    a = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}
    merged = {"allOf": [a, b]}
    out = closed({"type": "object", "properties": {"x": merged}})
    assert all("additionalProperties" not in part for part in out["properties"]["x"]["allOf"])
    run = Driver(tokenizer, forced_call_grammar([tool({"allOf": [a, b]})]))
    run.write('{"name":"get_weather","arguments":{"a":"1","b":"2"}}')  # both parts' names
    either = {**a, "anyOf": [b, {"required": ["a"]}]}
    out = closed(either)
    assert "additionalProperties" not in out and "additionalProperties" not in out["anyOf"][0]


def test_a_union_of_objects_closes_each_and_required_only_rules_close_the_object():
    a = {"type": "object", "properties": {"a": {"type": "string"}}}
    b = {"type": "object", "properties": {"b": {"type": "string"}}}
    out = closed({"type": "object", "properties": {"x": {"oneOf": [a, b]}}})
    assert all(m["additionalProperties"] is False for m in out["properties"]["x"]["oneOf"])
    one_of_two = {**a, "properties": {**a["properties"], **b["properties"]},
                  "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}  # fmt: skip
    assert closed(one_of_two)["additionalProperties"] is False


def test_an_object_that_requires_what_it_does_not_name_is_left_open():
    assert "additionalProperties" not in closed({"type": "object", "required": ["q"]})
    assert forced_call_grammar([tool({"type": "object", "required": ["q"]})])


A = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
B = {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}


@pytest.mark.parametrize(
    "parameters, call",
    [
        ({"type": "object", "anyOf": [A, B]}, '{"b":"x"}'),
        ({"type": "object", "oneOf": [A, B]}, '{"a":"x"}'),
        ({"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}}]}, '{"a":"x"}'),
        ({"type": "object", "$defs": {"args": A}, "$ref": "#/$defs/args"}, '{"a":"x"}'),
        ({"type": "object", "if": {"required": ["a"]}, "then": A, "else": B}, '{"b":"x"}'),
    ],
    ids=["anyOf", "oneOf", "allOf", "$ref", "if-then-else"],
)
def test_a_root_that_names_its_properties_through_others_takes_them(tokenizer, parameters, call):
    """A root `{"type": "object"}` whose properties other schemas name: closed by itself,
    it would admit only {} (and an anyOf of required properties, nothing)."""
    assert "additionalProperties" not in closed(parameters)
    run = Driver(tokenizer, forced_call_grammar([tool(parameters)]))
    run.write('{"name":"get_weather","arguments":' + call + "}")
    assert run.allowed == {0}
