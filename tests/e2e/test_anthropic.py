"""Anthropic's Messages API through the official `anthropic` SDK against live servers."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.helpers import WEATHER_PARAMETERS
from tests.live import serving

# Also run with our kernels and the CPU fast path off (README, the portable lane).
pytestmark = pytest.mark.portable

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_PARAMETERS,
}
HELLO = [{"role": "user", "content": "Say hello."}]
SYSTEM = "You are a terse assistant. " * 4


def client_of(live, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=api_key, max_retries=0)


def test_a_message_and_its_usage_in_anthropics_terms(tools_live):
    client = client_of(tools_live)
    first = client.messages.create(
        model="tiny", system=SYSTEM, messages=HELLO, max_tokens=12, extra_body={"temperature": 0}
    )
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.content[0].type == "text" and first.stop_reason in ("end_turn", "max_tokens")
    again = client.messages.create(
        model="tiny", system=SYSTEM, messages=HELLO, max_tokens=12, extra_body={"temperature": 0}
    )
    assert again.content[0].text == first.content[0].text
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    # The second time the prompt is served from the cache: input_tokens is what was not.
    assert again.usage.cache_read_input_tokens == total - 1 and again.usage.input_tokens == 1
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=HELLO)
    assert counted.input_tokens == total


def test_a_stream_comes_in_anthropics_event_order(tools_live):
    client = client_of(tools_live)
    kinds, text = [], ""
    with client.messages.stream(
        model="tiny", system=SYSTEM, messages=HELLO, max_tokens=12, extra_body={"temperature": 0}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    core = [k for k in kinds if k not in ("ping", "text")]
    assert core[0] == "message_start" and core[-2:] == ["message_delta", "message_stop"]
    assert core[1] == "content_block_start" and core[-3] == "content_block_stop"
    plain = client.messages.create(
        model="tiny", system=SYSTEM, messages=HELLO, max_tokens=12, extra_body={"temperature": 0}
    )
    assert text == final.content[0].text == plain.content[0].text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_an_eight_turn_agent_loop_reuses_the_cache(tools_live, tools_uncached):
    """Turns alternate between a forced call, answered by a tool result, and a reply in
    words, answered by the user: the history grows the way an agent's does."""

    def loop(live):
        client = client_of(live)
        messages: list = [{"role": "user", "content": "Weather in Paris this week?"}]
        replies = []
        for turn in range(8):
            call = turn % 2 == 0
            r = client.messages.create(
                model="tiny", system=SYSTEM, messages=messages, tools=[WEATHER],
                tool_choice={"type": "any" if call else "none"}, max_tokens=100 if call else 8,
                extra_body={"temperature": 0},
            )  # fmt: skip
            replies.append(r)
            messages.append({"role": "assistant", "content": r.content})
            if call:
                (use,) = [b for b in r.content if b.type == "tool_use"]
                assert r.stop_reason == "tool_use" and use.name == "get_weather"
                assert use.input["city"] in ("Paris", "Lyon", "Nice")
                assert 1 <= use.input["days"] <= 7
                result = {"type": "tool_result", "tool_use_id": use.id, "content": f"Sunny {turn}."}
                messages.append({"role": "user", "content": [result]})
            else:
                assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
                messages.append({"role": "user", "content": f"And on day {turn + 2}?"})
        return replies

    def said(r):
        return [b.input if b.type == "tool_use" else b.text for b in r.content]

    cached_replies, plain_replies = loop(tools_live), loop(tools_uncached)
    assert [said(r) for r in cached_replies] == [said(r) for r in plain_replies]
    for earlier, later in zip(cached_replies, cached_replies[1:], strict=False):
        seen = earlier.usage.input_tokens + earlier.usage.cache_read_input_tokens
        # The previous request's prompt and its reply are reused (the end token aside).
        assert later.usage.cache_read_input_tokens >= seen + earlier.usage.output_tokens - 1


def test_a_tool_use_streams_as_input_json_deltas(tools_live):
    with client_of(tools_live).messages.stream(
        model="tiny",
        messages=HELLO,
        tools=[WEATHER],
        max_tokens=100,
        extra_body={"temperature": 0},
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds
    (use,) = final.content
    assert (
        use.type == "tool_use"
        and use.id.startswith("toolu_")
        and set(use.input)
        == {
            "city",
            "days",
        }
    )
    assert final.stop_reason == "tool_use"


def test_claude_names_keys_and_errors_as_agents_send_them(tiny_model_dir):
    with serving(
        str(tiny_model_dir), served_model_name="tiny", api_keys=["k"], answer_any_model="off"
    ) as live:
        r = client_of(live, api_key="k").messages.create(  # sent as x-api-key
            model="claude-opus-4-7", messages=HELLO, max_tokens=4
        )
        assert r.model == "claude-opus-4-7" and r.content
        with pytest.raises(anthropic.AuthenticationError) as e:
            client_of(live, api_key="wrong").messages.create(
                model="tiny", messages=HELLO, max_tokens=4
            )
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "authentication_error"
        bad = httpx.post(
            live.url + "/v1/messages",
            json={"model": "tiny", "messages": HELLO},  # no max_tokens: required here
            headers={"x-api-key": "k"},
        )
        assert bad.status_code == 400
        assert bad.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": bad.json()["error"]["message"]},
        }
        with pytest.raises(anthropic.NotFoundError):
            client_of(live, api_key="k").messages.create(
                model="gpt-9", messages=HELLO, max_tokens=4
            )


def test_a_forced_call_cut_off_by_max_tokens_is_a_tool_use_with_what_parsed(tools_live):
    """Issue 59: the call cut off is still the call (stop_reason max_tokens says it is not
    one to run), as on every API; it was no block at all, while the stream sent one."""
    client = client_of(tools_live)
    kwargs = dict(
        model="tiny", messages=HELLO, tools=[WEATHER], tool_choice={"type": "any"},
        max_tokens=5, extra_body={"temperature": 0},
    )  # fmt: skip
    r = client.messages.create(**kwargs)
    assert r.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {})]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {})]


@pytest.mark.parametrize(
    "content", [None, ["not a block"], {"type": "text", "text": "x"}, [{"type": "video"}]]
)
def test_malformed_tool_results_are_400s_in_anthropics_shape(tools_live, content):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]},
    ]  # fmt: skip
    r = httpx.post(
        tools_live.url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": messages},
        timeout=60,
    )
    if content is None:  # null means not given: an empty result
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_blocks_claude_code_sends_are_taken_as_anthropic_documents_them(tools_live):
    """System turns among the messages, tool search (`tool_reference`, `defer_loading`),
    images, documents and search results, and Anthropic's server tools' blocks."""
    client = client_of(tools_live)
    deferred = {**WEATHER, "name": "get_forecast", "defer_loading": True}
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Find the forecast."},
            {"type": "document", "title": "Notes", "source": {
                "type": "text", "media_type": "text/plain", "data": "Rain expected."}},
            image, {"type": "container_upload", "file_id": "file_1"}]},
        {"role": "system", "content": "Agent types: general."},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
             "input": {"query": "forecast"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "bash_code_execution_tool_result", "tool_use_id": "srvtoolu_2",
             "content": {"type": "bash_code_execution_result", "stdout": "", "stderr": "",
                         "return_code": 0, "content": []}},
            {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"q": "fc"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "get_forecast"},
                {"type": "search_result", "source": "https://example.com", "title": "Forecast",
                 "content": [{"type": "text", "text": "Sunny."}]},
                image]}]},
    ]  # fmt: skip
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    tools = [search, WEATHER, deferred, server_tool]
    r = client.messages.create(
        model="tiny", messages=messages, tools=tools, max_tokens=4, extra_body={"temperature": 0}
    )
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # A deferred tool is offered once a tool search loaded it, and not before.
    before = messages[:1]

    def count(msgs, ts):
        return client.messages.count_tokens(model="tiny", messages=msgs, tools=ts).input_tokens

    assert count(before, [search, WEATHER, deferred]) == count(before, [search, WEATHER])
    assert count(messages, [search, WEATHER, deferred]) > count(messages, [search, WEATHER])
    forced = client.messages.create(
        model="tiny", messages=messages, tools=tools, max_tokens=200,
        tool_choice={"type": "tool", "name": "get_forecast"}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert [b.name for b in forced.content if b.type == "tool_use"] == ["get_forecast"]


def test_max_tokens_past_what_fits_is_lowered_not_refused_on_every_api(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", max_tokens_cap=6) as live:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 64000}  # as Claude Code asks
        r = httpx.post(live.url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["usage"]["output_tokens"] <= 6
        assert reply["stop_reason"] in ("max_tokens", "end_turn")
    with serving(str(tiny_model_dir), served_model_name="tiny", context_length=40) as live:
        chat = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        r = chat.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4000)
        # As OpenCode asks: past the context, lowered to what is left of it.
        assert r.usage.prompt_tokens + r.usage.completion_tokens <= 40
        assert r.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.BadRequestError) as e:  # a prompt that alone does not fit
            chat.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x" * 60}], max_tokens=4
            )
        assert e.value.body["code"] == "context_length_exceeded"


def test_pings_keep_a_slow_stream_alive(tools_live, monkeypatch):
    import mlx_cache_server.serving.anthropic as messages_api

    monkeypatch.setattr(messages_api, "PING_EVERY", 0.0005)
    body = {"model": "tiny", "max_tokens": 40, "messages": HELLO, "stream": True}
    with httpx.stream("POST", tools_live.url + "/v1/messages", json=body, timeout=60) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds.count("ping") > 1 and kinds[-1] == "message_stop"
    assert kinds.index("message_start") < kinds.index("content_block_start")


def test_configured_aliases_name_the_served_model_in_every_api(tiny_model_dir):
    from openai import OpenAI

    with serving(
        str(tiny_model_dir), served_model_name="tiny", model_aliases=["gpt-4o"],
        answer_any_model="off",
    ) as live:  # fmt: skip
        chat = OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        r = chat.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
        assert r.model == "gpt-4o"
        assert client_of(live).messages.create(model="gpt-4o", messages=HELLO, max_tokens=2)
        with pytest.raises(anthropic.NotFoundError):
            client_of(live).messages.create(model="gpt-5", messages=HELLO, max_tokens=2)


def claude_code_system(cch: str) -> list[dict]:
    header = f"x-anthropic-billing-header: cc_version=2.1.128.bd9; cc_entrypoint=cli; cch={cch};"
    return [{"type": "text", "text": header}, {"type": "text", "text": SYSTEM}]


def test_claude_codes_attribution_line_is_cut_by_default_so_sessions_reuse_the_cache(
    tiny_model_dir, tools_live
):
    def twice(live):
        client = client_of(live)
        return [
            client.messages.create(
                model="tiny",
                system=claude_code_system(cch),
                messages=HELLO,
                max_tokens=4,
                extra_body={"temperature": 0},
            )  # fmt: skip
            for cch in ("97bd6", "24c2d")
        ]

    with serving(
        str(tiny_model_dir), served_model_name="tiny", strip_attribution_header=False
    ) as live:
        _, kept = twice(live)
    with serving(str(tiny_model_dir), served_model_name="tiny") as live:
        first, second = twice(live)
        plain = client_of(live).messages.create(
            model="tiny", system=SYSTEM, messages=HELLO, max_tokens=4, extra_body={"temperature": 0}
        )
        total = first.usage.input_tokens + first.usage.cache_read_input_tokens
        assert second.usage.cache_read_input_tokens == total - 1
        # The line is gone from the prompt: it is the same as one that never had it.
        assert plain.usage.cache_read_input_tokens == total - 1
        assert plain.content == first.content == second.content
        counted = client_of(live).messages.count_tokens(
            model="tiny", system=claude_code_system("ead88"), messages=HELLO
        )
        assert counted.input_tokens == total
    # Kept, nothing after the changing token is reused: all that follows it (the line's
    # end, the system prompt, the messages) is prefilled again.
    assert kept.usage.input_tokens > total - 8


def test_refusals_before_the_route_come_in_anthropics_shape_too(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", max_body_bytes=2048) as live:
        with pytest.raises(anthropic.APIStatusError) as e:
            client_of(live).messages.create(
                model="tiny", messages=[{"role": "user", "content": "x" * 4096}], max_tokens=4
            )
        assert e.value.status_code == 413
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "request_too_large"
        headers = {f"x-h{i}": "1" for i in range(120)}
        r = httpx.post(live.url + "/v1/messages", json={}, headers=headers)
        assert r.status_code == 431 and r.json()["type"] == "error"


@pytest.mark.parametrize("tool", [{"type": "browser_toolset_20260801"}, {"name": 7}])
def test_a_client_tool_without_a_name_is_a_400_that_points_at_it(tools_live, tool):
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    r = httpx.post(
        tools_live.url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": HELLO,
              "tools": [server_tool, WEATHER, tool]},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "'name'" in error["message"]
