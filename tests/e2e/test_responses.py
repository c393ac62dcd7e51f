"""OpenAI's Responses API through the official `openai` SDK against live servers."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.helpers import WEATHER_PARAMETERS

# Also run with our kernels and the CPU fast path off (README, the portable lane).
pytestmark = pytest.mark.portable

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
}
INSTRUCTIONS = "You are a terse coding agent. " * 4
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}


def client_of(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_with_its_usage(tools_live):
    client = client_of(tools_live)
    kwargs = dict(model="tiny", instructions=INSTRUCTIONS, input="Say hello.",
                  max_output_tokens=12, temperature=0)  # fmt: skip
    first = client.responses.create(**kwargs)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
    again = client.responses.create(**kwargs)
    assert again.output_text == first.output_text
    # input_tokens counts every prompt token; the cached ones are in its details.
    assert again.usage.input_tokens == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == first.usage.input_tokens - 1


def test_a_stream_of_response_events(tools_live):
    client = client_of(tools_live)
    kwargs = dict(model="tiny", input="Say hello.", max_output_tokens=12, temperature=0)
    kinds, sequence, text, last = [], [], "", None
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            sequence.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
            last = event
    # 12 tokens run out before the tiny model ends its reply: the response is incomplete.
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert sequence == list(range(len(sequence)))
    assert text == last.response.output_text == client.responses.create(**kwargs).output_text


def test_an_eight_turn_agent_loop_reuses_the_cache(tools_live, tools_uncached):
    """Turns alternate between a forced call, answered by its output, and a reply in
    words, answered by the user, as Codex's history grows."""

    def loop(live):
        client = client_of(live)
        items: list = [{"role": "user", "content": "Weather in Paris this week?"}]
        replies = []
        for turn in range(8):
            call = turn % 2 == 0
            r = client.responses.create(
                model="tiny", instructions=INSTRUCTIONS, input=items, tools=[WEATHER],
                tool_choice="required" if call else "none", max_output_tokens=100 if call else 8,
                temperature=0,
            )  # fmt: skip
            replies.append(r)
            if call:
                (out,) = [o for o in r.output if o.type == "function_call"]
                args = json.loads(out.arguments)
                assert out.name == "get_weather" and args["city"] in ("Paris", "Lyon", "Nice")
                items += [
                    out,  # the SDK's own item, sent back as it came
                    {"type": "function_call_output", "call_id": out.call_id, "output": "Sunny."},
                ]
            else:
                (message,) = r.output
                assert message.type == "message" and r.output_text
                items += [message, {"role": "user", "content": f"And on day {turn + 2}?"}]
        return replies

    def said(r):
        return [o.arguments if o.type == "function_call" else r.output_text for o in r.output]

    cached, plain = loop(tools_live), loop(tools_uncached)
    assert [said(r) for r in cached] == [said(r) for r in plain]
    for earlier, later in zip(cached, cached[1:], strict=False):
        seen = earlier.usage.input_tokens + earlier.usage.output_tokens - 1
        assert later.usage.input_tokens_details.cached_tokens >= seen


def test_a_function_call_streams_its_arguments(tools_live):
    with client_of(tools_live).responses.stream(
        model="tiny", input="Weather?", tools=[WEATHER], max_output_tokens=100, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 1
    (call,) = final.output
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city", "days"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "shell_v9", "name": "sh"}]}, "tools[0]"),
        ({"tools": [{"type": ["web_search"]}]}, "tools[0]"),
        ({"tools": [{"type": "web_search"}, {"type": "custom"}]}, "tools[1].name"),
        ({"tools": [PATCH, {**WEATHER, "name": "apply_patch"}]}, "tools[1].name"),
        ({"tools": [{**PATCH, "format": "lark"}]}, "tools[0].format"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "custom", "name": "get_weather"}},
            "tool_choice",
        ),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]}, "input[0].input"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "telepathy_call"}]}, "input[0]"),
        ({"input": []}, "input"),
    ],
)
def test_what_is_not_supported_is_a_400_in_openais_shape(tools_live, body, param):
    r = httpx.post(
        tools_live.url + "/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_codex_shaped_input_is_taken_as_a_template_wants_it(tools_live):
    client = client_of(tools_live)
    r = client.responses.create(
        model="tiny",
        instructions=INSTRUCTIONS,
        input=[
            {"role": "developer", "content": "Work in /repo."},  # merged into the system turn
            {"role": "user", "content": [{"type": "input_text", "text": "Context."}]},
            {"role": "user", "content": "Fix the bug."},  # merged with the user turn before
        ],
        tools=[WEATHER, {"type": "web_search"}],  # a hosted tool: not offered, not refused
        max_output_tokens=4,
        temperature=0,
    )
    assert r.status == "incomplete" and r.output[0].status == "incomplete"


def test_a_custom_tool_call_round_trip_reuses_the_cache(tools_live, tools_uncached):
    """Codex's free-form tools: the call comes back as a custom_tool_call whose input is a
    string, and goes back in the next turn with its custom_tool_call_output."""

    def loop(live):
        client = client_of(live)
        items: list = [{"role": "user", "content": "Patch main.py."}]
        replies = []
        for _ in range(3):
            r = client.responses.create(
                model="tiny", instructions=INSTRUCTIONS, input=items, tools=[WEATHER, PATCH],
                tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=600,
                temperature=0,
            )  # fmt: skip
            (call,) = r.output
            assert call.type == "custom_tool_call" and call.name == "apply_patch"
            assert isinstance(call.input, str) and call.call_id.startswith("call_")
            replies.append(r)
            items += [
                call,  # the SDK's own item, sent back as it came
                {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."},
            ]
        return replies

    cached, plain = loop(tools_live), loop(tools_uncached)
    assert [r.output[0].input for r in cached] == [r.output[0].input for r in plain]
    for earlier, later in zip(cached, cached[1:], strict=False):
        seen = earlier.usage.input_tokens + earlier.usage.output_tokens - 1
        assert later.usage.input_tokens_details.cached_tokens >= seen


def test_a_custom_tool_call_streams_its_input(tools_live):
    kwargs = dict(
        model="tiny", input="Patch it.", tools=[PATCH], max_output_tokens=600, temperature=0,
        tool_choice={"type": "custom", "name": "apply_patch"},
    )  # fmt: skip
    client = client_of(tools_live)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    whole = client.responses.create(**kwargs).output[0]
    assert item.type == whole.type == "custom_tool_call"
    assert done.input == item.input == whole.input


def test_a_custom_call_cut_off_streams_the_input_it_had(tools_live):
    kwargs = dict(
        model="tiny", input="Patch it.", tools=[PATCH], max_output_tokens=50, temperature=0,
        tool_choice={"type": "custom", "name": "apply_patch"},
    )  # fmt: skip
    with client_of(tools_live).responses.stream(**kwargs) as stream:
        items = [e.item for e in stream if e.type == "response.output_item.done"]
    (item,) = items
    assert item.type == "custom_tool_call" and item.status == "incomplete"
    assert not item.input.startswith("{")  # the string so far, not its JSON wrapping
