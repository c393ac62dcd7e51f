"""Tool calls and structured output through the `openai` SDK against live servers."""

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
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


def client_of(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def valid_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"}
    assert args["city"] in ("Paris", "Lyon", "Nice") and 1 <= args["days"] <= 7
    return args


def test_a_required_call_is_a_valid_call(tools_live):
    r = client_of(tools_live).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    valid_weather(call.function.arguments)


def test_a_named_call_streams_as_tool_call_deltas(tools_live):
    stream = client_of(tools_live).chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        stream=True,
        temperature=0,
    )
    content, calls, finish, fragments = "", {}, None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            fragments += 1
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"  # no markup, no JSON, leaks into content
    (call,) = calls.values()
    assert call["name"] == "get_time" and call["id"].startswith("call_")
    assert fragments > 2  # the name first, then the arguments as they are generated
    args = json.loads(call["arguments"])
    assert set(args) == {"zone"} and len(args["zone"]) <= 8


def test_a_model_without_tool_templates_calls_and_chooses_and_reuses_its_turns(server, client):
    """The server's own tool protocol: a forced call, then `auto` (which agents send on
    every turn) on the same conversation, whose prompt begins with the turn before."""
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0
    )
    (call,) = r.choices[0].message.tool_calls
    valid_weather(call.function.arguments)
    first = r.usage.prompt_tokens + r.usage.completion_tokens
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24C."}]  # fmt: skip
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=40, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:  # any call the model opened is valid
        valid_weather(call.function.arguments)
    assert "<tool_call>" not in (choice.message.content or "")
    # The forced call re-rendered as generated: all but its end marker came from the cache.
    assert r.usage.prompt_tokens_details.cached_tokens >= first - 2


def test_an_eight_turn_tool_loop_reuses_the_cache(tools_live, tools_uncached):
    """Turns alternate between a forced call, answered by a tool message, and a reply in
    words, answered by the user."""

    def loop(live):
        client = client_of(live)
        messages: list = [{"role": "system", "content": "You answer with tools."}, *ASK]
        replies = []
        for turn in range(8):
            call = turn % 2 == 0
            r = client.chat.completions.create(
                model="tiny", messages=messages, tools=[WEATHER],
                tool_choice="required" if call else "none", max_tokens=None if call else 8,
                temperature=0,
            )  # fmt: skip
            replies.append(r)
            message = r.choices[0].message
            messages.append(message)  # the SDK's own type, sent back as it came
            if call:
                valid_weather(message.tool_calls[0].function.arguments)
                result = {"role": "tool", "tool_call_id": message.tool_calls[0].id}
                messages.append({**result, "content": f"Sunny, {20 + turn} degrees."})
            else:
                assert message.tool_calls is None and message.content
                messages.append({"role": "user", "content": "And tomorrow?"})
        return replies

    def said(r):
        message = r.choices[0].message
        return message.content, [c.function.arguments for c in message.tool_calls or []]

    cached, plain = loop(tools_live), loop(tools_uncached)
    assert [said(r) for r in cached] == [said(r) for r in plain]
    for earlier, later in zip(cached, cached[1:], strict=False):
        got = later.usage.prompt_tokens_details.cached_tokens
        # The previous request's prompt and reply are all reused: the template re-renders the
        # call (its marker written into the prompt, its JSON in the template's own style) and
        # the answer as the tokens generated; only the end token differs.
        u = earlier.usage
        assert got >= u.prompt_tokens + u.completion_tokens - 1, (got, u)


SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "admin": {"type": "boolean"},
                },
                "required": ["name", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enum and integer": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["colour", "count"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
}


def check(name: str, value) -> None:
    if name == "nested object":
        assert set(value) == {"user"} and set(value["user"]) == {"name", "admin"}
        assert isinstance(value["user"]["admin"], bool) and len(value["user"]["name"]) <= 6
    elif name == "enum and integer":
        assert value["colour"] in ("red", "green", "blue") and 0 <= value["count"] <= 99
    else:
        assert 1 <= len(value) <= 4 and all(isinstance(v, int) and 0 <= v <= 9 for v in value)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_replies_validate(tools_live, name):
    r = client_of(tools_live).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMAS[name], "strict": True},
        },
        max_tokens=200,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    check(name, json.loads(r.choices[0].message.content))


def test_json_object_replies_parse(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
        logit_bias={"94": 20},  # "}" in the tiny vocabulary: the object closes soon
        max_tokens=100,
        temperature=0,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_constrained_output_is_the_same_with_and_without_the_cache(tools_live, tools_uncached):
    array = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["array"]}}
    for kwargs in (
        {"tools": [WEATHER, TIME], "tool_choice": "required"},
        {"response_format": array},
    ):
        outputs = []
        for live in (tools_live, tools_live, tools_uncached):  # the second run is a cache hit
            r = client_of(live).chat.completions.create(
                model="tiny", messages=ASK, temperature=0, max_tokens=200, **kwargs
            )
            message = r.choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            outputs.append((message.content, calls))
        assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_it(tools_live, body, param):
    r = httpx.post(
        tools_live.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_null_means_not_given(server):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "seed": 1}
    nulls = {
        key: None
        for key in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "stop",
                    "frequency_penalty", "logit_bias", "n", "stream", "stream_options", "user",
                    "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
                    "max_completion_tokens")
    }  # fmt: skip
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    nulled = httpx.post(server.url + "/v1/chat/completions", json={**body, **nulls}, timeout=60)
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert plain.json()["choices"] == nulled.json()["choices"]


def test_constrained_and_free_requests_admitted_together_each_get_their_own(
    tiny_tools_model_dir,
):
    """Two constraints and a free request in one batch (BatchGenerator's batched prefill)."""
    from mlx_cache_server.engine import Delta, SamplingParams
    from mlx_cache_server.engine.constraint import build_constraint
    from mlx_cache_server.models.engine_build import build_engine
    from mlx_cache_server.serving.structured import json_grammar
    from tests.helpers import ended, wait_until
    from tests.live import settings_of

    grammars = {
        name: json_grammar(SCHEMAS[name], "schema") for name in ("array", "enum and integer")
    }

    def run(names, together):
        engine = build_engine(settings_of(no_cache=True), str(tiny_tools_model_dir))
        prompt = engine.tokenizer.apply_chat_template(ASK, add_generation_prompt=True)

        def params(name):
            constraint = build_constraint(engine.grammars, grammars[name]) if name else None
            return SamplingParams(max_tokens=100, temperature=0, constraint=constraint)

        sinks = {name: [] for name in names}
        if together:  # queued before the thread starts: one intake admits them all
            for name in names:
                engine.submit(prompt, params(name), sinks[name].append)
            engine.start()
            wait_until(lambda: all(ended(s) for s in sinks.values()))
        else:
            engine.start()
            for name in names:
                engine.submit(prompt, params(name), sinks[name].append)
                wait_until(lambda name=name: ended(sinks[name]))
        engine.stop()
        return {n: "".join(e.text for e in s if isinstance(e, Delta)) for n, s in sinks.items()}

    names = ["array", None, "enum and integer"]
    alone, together = run(names, together=False), run(names, together=True)
    assert together == alone
    for name in ("array", "enum and integer"):
        check(name, json.loads(together[name]))


def test_a_change_in_the_system_text_keeps_the_tools_in_the_cache(server, client):
    """The server's own tool protocol writes the tools before the system text: an agent's
    system text names its working directory, and a session in another folder still
    reuses the tools' KV (issue 59: 565 of Claude Code's 11,875 tokens, with them after)."""
    from mlx_cache_server.serving.prompted_tools import tools_section

    tools = [
        {"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Tool number {i}: does thing {i} to a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        }}
        for i in range(14)
    ]  # fmt: skip
    rules = "You are a coding agent. Answer briefly and use the tools. " * 4

    def ask(folder: str) -> int:
        system = f"{rules}\nWorking directory: {folder}\nIs a git repository: false"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=1, temperature=0
        )
        return r.usage.prompt_tokens_details.cached_tokens

    ask("/tmp/agents/one")
    cached = ask("/tmp/agents/two")
    assert cached >= len(tools_section(tools))  # one token a character, on the tiny model
