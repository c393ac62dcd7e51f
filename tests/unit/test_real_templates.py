"""The server's rendering under the real chat templates of 17 current models.

Tokenizers only (no weights): each template's tokenizer loads with mlx-lm's loader, which
infers the real model's tool parser, and a chat, a chat with tools, and a tool loop's
history render through `mlx_cache_server.serving.template`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load
from mlx_lm.tool_parsers import pythonic

from mlx_cache_server.serving.api_errors import APIError
from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
from mlx_cache_server.serving.template import render
from mlx_cache_server.serving.tools import plan_tools
from tests.real_templates import REAL_TEMPLATES, write_template_tokenizer
from tests.tiny_model import write_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "call_0123456789abcdef01234567"  # the form we issue on chat completions


def loop(arguments: str = '{"city": "Paris"}', call_id: str = CALL_ID) -> list[dict[str, Any]]:
    """A client's third request of a tool loop: the call, its result, the answer, a new turn."""
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny"},
        {"role": "assistant", "content": "Sunny in Paris."},
        {"role": "user", "content": "Thanks!"},
    ]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("real-templates")
    return {f: load(write_template_tokenizer(root / f, f)) for f in REAL_TEMPLATES}


def rendered(tokenizer: Any, messages: list[dict[str, Any]], tools: bool = True) -> str:
    engine = SimpleNamespace(
        tokenizer=tokenizer, cache=None, cache_mode="", vision=None, no_images=""
    )
    req = ChatCompletionRequest(model="x", messages=messages, tools=TOOLS if tools else None)
    return tokenizer.decode(render(engine, req, plan_tools(req, engine)))


@pytest.mark.parametrize("file", sorted(REAL_TEMPLATES))
def test_each_template_loads_with_the_real_models_parser(tokenizers, file):
    tokenizer, real = tokenizers[file], REAL_TEMPLATES[file]
    parser = getattr(tokenizer.tool_parser, "__module__", None)
    assert parser == (real.parser and f"mlx_lm.tool_parsers.{real.parser}")
    assert (tokenizer.think_start == "<think>") == real.think
    for token in real.special:  # each a single token
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token


@pytest.mark.parametrize("file", sorted(REAL_TEMPLATES))
def test_each_template_renders_a_chat_tools_and_a_tool_loop(tokenizers, file):
    tokenizer = tokenizers[file]
    assert "Hi there" in rendered(tokenizer, [{"role": "user", "content": "Hi there"}], False)
    assert "get_weather" in rendered(tokenizer, [{"role": "user", "content": "Hi"}])
    for arguments in ('{"city": "Paris"}', ""):  # "": a call without arguments
        text = rendered(tokenizer, loop(arguments))
        history = text[text.index("Weather in Paris?") :]
        assert "Sunny" in history and "Thanks!" in history
        assert "get_weather" in history, "the call is part of the history"


MISTRAL = "Mistral-Small-3.2-24B-Instruct-2506.jinja"


def call_ids(text: str) -> tuple[list[str], list[str]]:
    calls = re.findall(r"\[CALL_ID\](\w*)\[ARGS\]", text)
    return calls, re.findall(r"\[TOOL_RESULTS\](\w*)\[", text)


def test_mistral_renders_any_call_id_as_nine_characters_the_same_each_time(tokenizers):
    tokenizer = tokenizers[MISTRAL]
    for call_id in (CALL_ID, "toolu_01AbCdEfGhIjKlMnOpQrStUv", "x"):
        text = rendered(tokenizer, loop(call_id=call_id))
        calls, results = call_ids(text)
        assert calls == results and re.fullmatch(r"[A-Za-z0-9]{9}", calls[0])
        assert rendered(tokenizer, loop(call_id=call_id)) == text  # a stable prompt prefix
    other = call_ids(rendered(tokenizer, loop(call_id=CALL_ID + "0")))[0]
    assert other != call_ids(rendered(tokenizer, loop(call_id=CALL_ID)))[0]
    assert call_ids(rendered(tokenizer, loop(call_id="abc123XYZ")))[0] == ["abc123XYZ"]


def test_mistral_renders_the_ids_we_build_on_its_own_as_generated(tokenizers):
    """A call's id is `call_` and the 9 characters the model generated (`toolu_` and them
    on Messages): either renders back as those characters."""
    for call_id in ("call_a1B2c3D4e", "toolu_a1B2c3D4e"):
        calls, results = call_ids(rendered(tokenizers[MISTRAL], loop(call_id=call_id)))
        assert calls == results == ["a1B2c3D4e"]


def test_mistral_takes_a_user_turn_right_after_a_tool_result(tokenizers):
    """Its template requires user and assistant turns to alternate, a result standing for
    none: an empty assistant turn closes the results before the client's next question."""
    messages = [*loop()[:3], {"role": "user", "content": "And tomorrow?"}]
    text = rendered(tokenizers[MISTRAL], messages)
    assert re.search(r"\[TOOL_RESULTS\]\w{9}\[TOOL_CONTENT\]Sunny\[/TOOL_RESULTS\]</s>", text)
    assert text.endswith("[INST]And tomorrow?[/INST]")
    assert text.count("</s>") == 2  # the call's turn, and the empty answer


def test_a_templates_own_rule_is_a_400_in_its_words(tokenizers):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(APIError) as e:
        rendered(tokenizers[MISTRAL], messages)
    assert e.value.status == 400 and "alternate" in e.value.message


def test_hermes_3_renders_without_tools(tokenizers):
    text = rendered(tokenizers["NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"],
                    [{"role": "user", "content": "Hi there"}], tools=False)  # fmt: skip
    assert "Hi there" in text


def test_arguments_that_are_no_json_object_name_the_field_where_the_template_needs_one(
    tokenizers,
):
    with pytest.raises(APIError) as e:
        rendered(tokenizers["Qwen3-Coder.jinja"], loop("not json"))
    assert e.value.status == 400
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    assert "JSON object" in e.value.message
    # A template that writes them as a string takes them.
    assert "not json" in rendered(tokenizers["Qwen-Qwen2.5-7B-Instruct.jinja"], loop("not json"))


def test_lfm_keeps_the_call_in_history_in_its_own_syntax(tokenizers):
    text = rendered(tokenizers["LFM2.5-Instruct.jinja"], loop('{"city": "Paris", "days": 2}'))
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"
    assert f'{start}[get_weather(city="Paris", days=2)]{end}' in text
    call = text[text.index(start) + len(start) : text.index(end)]
    assert pythonic.parse_tool_call(call) == {
        "name": "get_weather",
        "arguments": {"city": "Paris", "days": 2},
    }


def test_a_template_failing_on_valid_input_falls_back_and_says_why(tmp_path, caplog):
    # Fails on any tool result: `tool_call_id + 1` is no string operation.
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ m.tool_call_id + 1 }}{% endif %}"
        "{% if m.tool_calls %}{% set tool_call = m.tool_calls[0].function %}"
        "<tool_call>{{ tool_call.name }}</tool_call>{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
        "{{ '<|im_start|>assistant\n' if add_generation_prompt }}"
    )
    path = tmp_path / "tok"
    path.mkdir()
    write_tokenizer(path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], template)
    tokenizer = load(Path(path))
    with caplog.at_level(logging.WARNING, logger="mlx_cache_server.serving.template"):
        text = rendered(tokenizer, loop())
    assert "<tool_response>\nSunny" in text and "Thanks!" in text
    assert "server's own protocol" in caplog.text
