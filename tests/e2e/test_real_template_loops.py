"""A client's tool loop through the `openai` and `anthropic` SDKs on a tiny model under Mistral
Small 3.2's real template, which requires call ids of 9 alphanumeric characters: the ids the
clients send back (`call_...`, `toolu_...`) are rendered in its form, never refused. The
template also requires user and assistant turns to alternate: a question right after a
tool's result (on Messages, in the same user message) is taken, not refused."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.helpers import WEATHER_PARAMETERS
from tests.live import serving
from tests.real_templates import build_template_model

MISTRAL = "Mistral-Small-3.2-24B-Instruct-2506.jinja"
QUESTION = "What is the weather in Paris?"
OPTIONS = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def mistral_live(tmp_path_factory: pytest.TempPathFactory):
    path = build_template_model(tmp_path_factory.mktemp("mistral"), MISTRAL)
    with serving(str(path), served_model_name="tiny") as live:
        yield live


def test_an_openai_tool_loop_with_our_ids(mistral_live):
    client = openai.OpenAI(base_url=mistral_live.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": WEATHER_PARAMETERS}}]  # fmt: skip
    messages = [{"role": "user", "content": QUESTION}]
    client.chat.completions.create(model="tiny", messages=messages, tools=tools, **OPTIONS)
    call_id = "call_abc123def456abc123def456"
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 24 C"},
    ]  # fmt: skip
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=tools, **OPTIONS)
    messages += [
        {"role": "assistant", "content": answer.choices[0].message.content or "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    last = client.chat.completions.create(model="tiny", messages=messages, tools=tools, **OPTIONS)
    assert last.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_anthropic_tool_loop_with_toolu_ids(mistral_live):
    client = anthropic.Anthropic(base_url=mistral_live.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_PARAMETERS}]
    options = {"model": "tiny", "tools": tools, "max_tokens": 8, "extra_body": {"temperature": 0}}
    messages: list = [{"role": "user", "content": QUESTION}]
    client.messages.create(messages=messages, **options)
    use_id = "toolu_01A09q90qw90lq917835lq9"
    messages += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use_id,
         "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id,
                                      "content": "Sunny, 24 C"}]},
    ]  # fmt: skip
    answer = client.messages.create(messages=messages, **options)
    text = "".join(b.text for b in answer.content if b.type == "text") or "Sunny."
    messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And tomorrow?"},
    ]
    last = client.messages.create(messages=messages, **options)
    assert last.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_an_openai_question_right_after_a_tool_result(mistral_live):
    client = openai.OpenAI(base_url=mistral_live.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": WEATHER_PARAMETERS}}]  # fmt: skip
    messages: list = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, tool_choice="required", max_tokens=200,
        temperature=0,
    )  # fmt: skip
    (call,) = first.choices[0].message.tool_calls
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    last = client.chat.completions.create(model="tiny", messages=messages, tools=tools, **OPTIONS)
    assert last.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_anthropic_forced_call_its_result_and_a_question_in_one_message(mistral_live):
    """The call's `toolu_` id renders back as generated: the request with its result
    reuses the whole call; the next holds the result and a question in one message."""
    client = anthropic.Anthropic(base_url=mistral_live.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_PARAMETERS}]
    options = {"model": "tiny", "tools": tools, "extra_body": {"temperature": 0}}
    messages: list = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(
        messages=messages, tool_choice={"type": "any"}, max_tokens=200, **options
    )
    (use,) = [b for b in first.content if b.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
    messages.append({"role": "assistant", "content": [use.model_dump()]})
    second = client.messages.create(
        messages=[*messages, {"role": "user", "content": [result]}], max_tokens=4, **options
    )
    usage = first.usage  # `input_tokens` counts the uncached part of the prompt only
    whole = usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens - 1
    assert second.usage.cache_read_input_tokens >= whole
    question = {"type": "text", "text": "And tomorrow?"}
    asked = [*messages, {"role": "user", "content": [result, question]}]
    last = client.messages.create(messages=asked, max_tokens=8, **options)
    assert last.stop_reason in ("end_turn", "max_tokens", "tool_use")
