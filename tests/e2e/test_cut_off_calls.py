"""A forced tool call cut off by max_tokens comes back as a call on every API, through the
official SDKs: chat completions as `tool_calls` with finish_reason "length" (never as the
reply's text, which a client cannot tell from an answer), Messages as a tool_use block with
what of its input parses and stop_reason "max_tokens", Responses as an incomplete response
with its function_call item incomplete; streamed as not."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.helpers import WEATHER_PARAMETERS

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMETERS}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# One token a character on the tiny model: 8 cut the call within its name, 45 within its
# arguments (the call's head is some 34 characters).
CUTS = [8, 45]


@pytest.fixture(params=["no tools", "tools"])
def live(request):
    """The server's own tool protocol (a template without tools), and a template's own."""
    return request.getfixturevalue("server" if request.param == "no tools" else "tools_live")


def openai_client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("limit", CUTS)
def test_chat_completions_give_the_call_as_far_as_it_came(live, limit):
    client = openai_client(live)
    kwargs = dict(model="tiny", messages=ASK, tools=[{"type": "function", "function": WEATHER}],
                  tool_choice="required", max_tokens=limit, temperature=0)  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = call.function.arguments
    assert (arguments == "") if limit == 8 else (arguments.startswith("{") and not_json(arguments))
    # Streamed: the same call in tool_calls deltas, then finish_reason "length".
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert {t.index for t in calls} == {0}
    assert "".join(t.function.arguments or "" for t in calls) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_messages_give_a_tool_use_block_with_what_parsed(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    # 55: the call cut after its city, before its days are whole.
    kwargs = dict(model="tiny", messages=ASK, max_tokens=55, extra_body={"temperature": 0},
                  tools=[{"name": "get_weather", "description": WEATHER["description"],
                          "input_schema": WEATHER_PARAMETERS}],
                  tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "max_tokens"
    (block,) = whole.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input["city"] in ("Paris", "Lyon", "Nice") and set(block.input) <= {"city", "days"}
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()  # the SDK parses the partial JSON as it comes
    assert streamed.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", block.input)
    ]


def test_responses_give_an_incomplete_function_call(live):
    client = openai_client(live)
    kwargs = dict(model="tiny", input="What is the weather in Paris this week?",
                  tools=[{"type": "function", **WEATHER}], tool_choice="required",
                  max_output_tokens=45, temperature=0)  # fmt: skip
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    (item,) = whole.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert item.name == "get_weather" and not_json(item.arguments)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    (done,) = [e.response for e in events if e.type == "response.incomplete"]
    (streamed,) = done.output
    assert (streamed.type, streamed.status, streamed.name, streamed.arguments) == (
        "function_call",
        "incomplete",
        "get_weather",
        item.arguments,
    )
