"""Forced tool calls and a client's tool loop under the real chat templates of 17 current
models (tests/fixtures/templates), on tiny random-weight models: the forced call parses and
validates on chat completions, Messages and Responses, the request after the tool's result
is served from the cache through the whole call, wherever the call is written in the
model's own markup, and the loop's next user turn is answered (issue 56)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.live import serving
from tests.real_templates import REAL_TEMPLATES, build_template_model

CITIES, UNITS = ["Paris", "Lyon"], ["c", "f"]
PARAMETERS = {"type": "object", "properties": {"city": {"enum": CITIES}, "unit": {"enum": UNITS}},
              "required": ["city", "unit"]}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS},
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Templates whose next turn does not hold the generated call token for token, and why.
# Everywhere else the next prompt reuses the previous one and every token of the call but
# the one that ended the reply (the template writes its own end of call there).
NOT_REUSED = {
    # The template re-renders the previous generation prompt differently (its `<think>`).
    "deepseek-ai-DeepSeek-V3.1.jinja": "the template rewrites the previous turn's thinking",
}  # fmt: skip
FORCED = {"temperature": 0, "max_tokens": 200}


def valid(arguments: dict) -> bool:
    return (
        arguments.get("city") in CITIES and arguments.get("unit") in UNITS and len(arguments) == 2
    )


@pytest.fixture(scope="module", params=sorted(REAL_TEMPLATES))
def live(request, tmp_path_factory):
    path = build_template_model(tmp_path_factory.mktemp("template"), request.param)
    with serving(str(path), served_model_name="tiny") as server:
        yield request.param, server


def test_a_forced_call_parses_the_next_turn_reuses_it_and_the_loop_goes_on(live):
    file, server = live
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", **FORCED
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", (file, choice)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and valid(json.loads(call.function.arguments))
    history = [
        *QUESTION,
        {"role": "assistant", "content": choice.message.content,
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]  # fmt: skip
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    whole = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    if file in NOT_REUSED:
        assert cached < whole, f"{file} now reuses its call: drop it from NOT_REUSED"
    else:
        assert cached >= whole, (file, cached, whole)
    # The loop's third request, as a client sends it: the model's answer, a new question.
    answer = second.choices[0].message.content or "It is sunny."
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": "And in Lyon?"}]  # fmt: skip
    third = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert third.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert third.usage.prompt_tokens > second.usage.prompt_tokens


def test_a_forced_call_on_messages_and_responses(live):
    file, server = live
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}]
    message = claude.messages.create(
        model="tiny", messages=QUESTION, tools=tools, tool_choice={"type": "any"},
        max_tokens=200, extra_body={"temperature": 0},
    )  # fmt: skip
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather" and valid(use.input)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(
        model="tiny", input="What is the weather in Paris?", max_output_tokens=200,
        temperature=0, tool_choice="required",
        tools=[{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
    )  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and valid(json.loads(call.arguments)), file
