"""Forced tool calls on the embedded default model (SmolLM2-135M), through the OpenAI SDK.

The model's template knows no tools, so it gets the server's own protocol and the
call runs under the forced-call grammar. Left to itself it invents properties
(`unit_type`, `description`, ...) until `max_tokens`; a tool's arguments are a
closed object, so the call ends with the properties the tool declares.
"""

from __future__ import annotations

import json

import pytest
from anthropic import Anthropic
from openai import OpenAI

from mlx_cache_server.models.default_model import default_model_dir
from tests.live import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client():
    with serving(str(default_model_dir())) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        client.served = client.models.list().data[0].id
        yield client


def create(client: OpenAI, choice, stream: bool):
    return client.chat.completions.create(
        model=client.served, messages=ASK, tools=[WEATHER], tool_choice=choice,
        temperature=0, max_tokens=80, stream=stream,
    )  # fmt: skip


def declared_only(name: str, arguments: str) -> None:
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) <= {"city", "unit"} and {"city", "unit"} <= set(args), args


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_ends_with_the_declared_properties(client, choice):
    reply = create(client, choice, stream=False).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    (call,) = reply.message.tool_calls
    declared_only(call.function.name, call.function.arguments)


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_streamed_forced_call_ends_with_the_declared_properties(client, choice):
    name, arguments, finish = "", "", None
    for chunk in create(client, choice, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls", (name, arguments)
    declared_only(name, arguments)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
                         ids=["any", "tool"])  # fmt: skip
def test_anthropics_forced_tool_use_ends_with_the_declared_properties(client, choice):
    function = WEATHER["function"]
    tool = {"name": function["name"], "description": function["description"],
            "input_schema": function["parameters"]}  # fmt: skip
    reply = Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x",
                      max_retries=0).messages.create(
        model=client.served, messages=ASK, tools=[tool], tool_choice=choice, max_tokens=80,
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert reply.stop_reason == "tool_use", reply
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    declared_only(use.name, json.dumps(use.input))


def test_a_responses_forced_call_ends_with_the_declared_properties(client):
    function = WEATHER["function"]
    reply = client.responses.create(
        model=client.served, input=ASK[0]["content"], tool_choice="required",
        tools=[{"type": "function", **function}], max_output_tokens=80, temperature=0,
    )  # fmt: skip
    assert reply.status == "completed", reply
    (call,) = [item for item in reply.output if item.type == "function_call"]
    declared_only(call.name, call.arguments)
