"""Tool-call markup read out of a streamed reply, and sampling defaults, alone."""

from __future__ import annotations

import json
from types import SimpleNamespace

from mlx_lm.tool_parsers import json_tools

from mlx_cache_server.models.folders import generation_config
from mlx_cache_server.serving.defaults import sampling_defaults
from mlx_cache_server.serving.tools import ToolCallText, forced_call, template_tool_calls
from mlx_cache_server.settings import Settings

ENGINE = SimpleNamespace(
    tokenizer=SimpleNamespace(
        tool_call_start="<tool_call>",
        tool_call_end="</tool_call>",
        tool_parser=json_tools.parse_tool_call,
    )
)
REPLY = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def run(pieces: list[str]) -> tuple[str, list]:
    text = ToolCallText(ENGINE, [])
    content, calls = "", []
    for piece in pieces:
        c, k = text.feed(piece)
        content, calls = content + c, calls + k
    c, k = text.finish()
    return content + c, calls + k


def test_markup_never_reaches_the_content_however_the_reply_is_split():
    for size in (1, 2, 3, 7, len(REPLY)):
        content, calls = run([REPLY[i : i + size] for i in range(0, len(REPLY), size)])
        assert content == "Let me check. "
        assert [c.function.name for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert len({c.id for c in calls}) == 2


def test_text_that_only_looks_like_a_marker_is_content():
    assert run(["a <tool", "_cal", "x> b"]) == ("a <tool_calx> b", [])


def test_an_unclosed_call_is_parsed_at_the_end_or_given_back_as_text():
    content, calls = run(['<tool_call>{"name": "f", "arguments": {"a": 1}}'])
    assert content == "" and calls[0].function.name == "f"
    assert run(["<tool_call>not json"]) == ("<tool_call>not json", [])


def test_markup_that_is_no_call_is_content_not_dropped():
    bad = 'Sure. <tool_call>{"name": "f", "arguments": {oops}}</tool_call> Done.'
    for size in (1, 3, len(bad)):
        assert run([bad[i : i + size] for i in range(0, len(bad), size)]) == (bad, [])
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert run([nameless]) == (nameless, [])


def test_a_forced_reply_is_one_call_unless_it_was_cut_off():
    (call,) = forced_call('{"name":"f","arguments":{"x":[1,2]}}')
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"x": [1, 2]}
    assert forced_call('{"name":"f","argu') == []


def test_calls_sent_back_reach_the_template_with_object_arguments():
    sent = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert template_tool_calls(sent)[0]["function"]["arguments"] == {"a": 1}


def test_sampling_defaults_come_from_settings_then_the_model_then_openai():
    model = {"temperature": 0.3, "top_k": 20}
    d = sampling_defaults(Settings(), model)
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.3, 1.0, 20, 0.0)
    d = sampling_defaults(Settings(temperature=0.9), model)
    assert (d.temperature, d.top_k) == (0.9, 20) and "settings" in d.source
    assert sampling_defaults(Settings(), {}).temperature == 1.0


def test_a_models_generation_config_gives_its_sampling_values(tmp_path):
    assert generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"do_sample": False, "temperature": 0.6, "top_p": 0.8, "eos_token_id": 2, "top_k": True}
        )
    )
    assert generation_config(tmp_path) == {"temperature": 0.0, "top_p": 0.8}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_config(tmp_path) == {}


def test_a_streamed_reply_gives_content_then_indexed_call_deltas():
    from mlx_cache_server.serving.chat import Reply
    from mlx_cache_server.serving.tools import ToolPlan

    req = SimpleNamespace(tools=[])
    reply = Reply(ENGINE, req, ToolPlan("auto", []))
    content, deltas = "", []
    for i in range(0, len(REPLY), 5):
        c, d = reply.feed(REPLY[i : i + 5])
        content, deltas = content + c, deltas + d
    c, d = reply.finish()
    content, deltas = content + c, deltas + d
    assert content == "Let me check. " and [d.index for d in deltas] == [0, 1]
    assert [d.function.name for d in deltas] == ["get_weather", "get_time"] and reply.calls == 2
    # tool_choice "none" with the tools shown: markup still never reaches the content.
    reply = Reply(ENGINE, req, ToolPlan("none", [{"type": "function"}]))
    assert reply.whole(REPLY) == ("Let me check. ", [])


def test_a_forced_call_streams_its_name_first_then_argument_fragments():
    from mlx_cache_server.serving.chat import Reply
    from mlx_cache_server.serving.tools import ToolPlan

    reply = Reply(ENGINE, SimpleNamespace(tools=[]), ToolPlan("forced", []))
    text = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    deltas = []
    for i in range(0, len(text), 4):
        deltas += reply.feed(text[i : i + 4])[1]
    deltas += reply.finish()[1]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    arguments = "".join(d.function.arguments for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "days": 3} and len(deltas) > 3
    # Its head and first fragment in one piece: one entry for index 0, not two.
    whole = Reply(ENGINE, SimpleNamespace(tools=[]), ToolPlan("forced", [])).feed(text)[1]
    assert [d.index for d in whole] == [0] and whole[0].function.name == "get_weather"
    assert whole[0].function.arguments == '{"city": "Paris", "days": 3}'


def test_a_forced_call_cut_off_is_a_call_as_far_as_it_came_whole_or_streamed():
    from mlx_cache_server.serving.chat import Reply
    from mlx_cache_server.serving.tools import ToolPlan, cut_off_call

    names = ("get_weather", "get_time")
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    # Where it is cut: the name it gets (a name cut off is the one tool it could become, else
    # what there is of it).
    named = {0: "", 5: "", 14: "get_", 16: "get_weather", 24: "get_weather", 37: "get_weather",
             40: "get_weather", len(call) - 1: "get_weather"}  # fmt: skip
    for cut, name in named.items():
        text = call[:cut]
        plan = ToolPlan("forced", [], names=names)
        content, (whole,) = Reply(ENGINE, SimpleNamespace(tools=[]), plan).whole(text)
        assert content is None
        reply = Reply(ENGINE, SimpleNamespace(tools=[]), plan)
        deltas = [d for i in range(0, len(text), 3) for d in reply.feed(text[i : i + 3])[1]]
        content, more = reply.finish()
        deltas += more
        assert content == "" and deltas[0].id and [d.index for d in deltas] == [0] * len(deltas)
        assert deltas[0].function.name == whole.function.name
        assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
        assert whole.function.arguments == text[37:]  # after `"arguments": `
        assert whole.function.name == name
    assert cut_off_call('{"name": "get_w', ("get_weather",)).function.name == "get_weather"
    markup = cut_off_call("<function=get_time>\n<parameter=zo", names, markup=True)
    assert markup.function.name == "get_time" and markup.function.arguments.startswith("<")
