"""gpt-oss's harmony format on its real chat template: replies split into reasoning,
content and calls (whole and streamed alike), forced calls generated as the template
writes them back, and the history rendered so the next prompt holds the generated call."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest
from transformers import PreTrainedTokenizerFast

from mlx_cache_server.serving import harmony
from mlx_cache_server.serving.chat import Reply
from mlx_cache_server.serving.openai_bodies import ChatCompletionRequest
from mlx_cache_server.serving.template import render
from mlx_cache_server.serving.tools import plan_tools, tool_call
from tests.tiny_model import SPECIAL, build_tokenizer
from tests.unit.test_prompted_tools import Driver

TEMPLATE = (
    Path(__file__).parents[1] / "fixtures" / "templates" / "openai-gpt-oss-120b.jinja"
).read_text()
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
           "<|constrain|>"]  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
           "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time.",
        "parameters": {"type": "object", "properties": {}}}}  # fmt: skip

# What gpt-oss writes after its generation prompt `<|start|>assistant` (its end tokens,
# `<|return|>` and `<|call|>`, stop it and are not in the text).
ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple.\n\nAnswer: 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**."
)
CALLING = (
    "<|channel|>analysis<|message|>Need weather; call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris","unit":"c"}'
)


@pytest.fixture(scope="module")
def tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(SPECIAL + HARMONY))
    hf.chat_template = TEMPLATE
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=0)


def split(keep_calls: bool = True) -> harmony.HarmonySplit:
    return harmony.HarmonySplit(partial(tool_call, arguments=""), keep_calls)


def streamed(text: str, size: int, keep_calls: bool = True) -> tuple[str, str, list]:
    """The pieces `text` streams as, `size` characters at a time, joined."""
    s, reasoning, content, deltas = split(keep_calls), "", "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for out in [*map(s.feed, pieces), s.finish()]:
        reasoning, content, deltas = reasoning + out[0], content + out[1], deltas + out[2]
    return reasoning, content, deltas


def test_the_template_and_vocabulary_are_recognised(tokenizer):
    assert harmony.is_harmony(tokenizer[0])
    assert harmony.is_harmony(SimpleNamespace(chat_template=None, get_vocab=tokenizer[0].get_vocab))
    assert not harmony.is_harmony(SimpleNamespace(chat_template="{{ messages }}<|im_start|>"))


def test_analysis_is_reasoning_and_final_is_content():
    reasoning, content, calls = split().whole(ANSWER)
    assert reasoning == "User asks 2+2. Simple.\n\nAnswer: 4."
    assert content == "2 + 2 = **4**." and calls == []


def test_a_commentary_message_to_a_function_is_a_call():
    reasoning, content, calls = split().whole(CALLING)
    assert reasoning == "Need weather; call get_weather."
    assert content is None
    ((call,),) = [calls]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}


# Plain text whose line break comes before a `<|message|>`, and words after a message's
# end: a review found the whole reply and the stream reading them differently.
ODD = ["Sure.\nHere you go<|message|>tail", ANSWER + "<|end|>trailing words"]


@pytest.mark.parametrize("text", ODD)
@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_text_that_is_no_message_reads_the_same_streamed_and_whole(text, size):
    reasoning, content, _ = split().whole(text)
    assert streamed(text, size)[:2] == (reasoning or "", content or "")
    assert content.endswith("tail") or content.endswith("trailing words")


@pytest.mark.parametrize("text", [ANSWER, CALLING, ANSWER + "<|return|>"])
@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_streaming_piece_by_piece_splits_as_the_whole_reply_does(text, size):
    whole_reasoning, whole_content, calls = split().whole(text)
    reasoning, content, deltas = streamed(text, size)
    assert reasoning == whole_reasoning and content == (whole_content or "")
    assert "<|" not in reasoning + content
    # A call goes out once with its id and name, then its arguments as they come.
    assert [d.function.name for d in deltas if d.id] == [c.function.name for c in calls]
    assert "".join(d.function.arguments or "" for d in deltas) == "".join(
        c.function.arguments for c in calls
    )
    assert all(d.index == 0 for d in deltas)


def test_a_plain_reply_is_content_and_tool_choice_none_drops_calls():
    assert split().whole("Just text, no channels.") == (None, "Just text, no channels.", [])
    assert streamed("Line one\nline two", 3) == ("", "Line one\nline two", [])
    reasoning, content, deltas = streamed(CALLING, 4, keep_calls=False)
    assert reasoning == "Need weather; call get_weather." and content == "" and deltas == []


def fake_engine(hf) -> SimpleNamespace:
    wrapper = SimpleNamespace(
        chat_template=hf.chat_template,
        has_tool_calling=False,  # mlx-lm knows no harmony parser
        apply_chat_template=partial(hf.apply_chat_template, return_dict=False),
        encode=hf.encode,
        decode=hf.decode,
    )
    return SimpleNamespace(tokenizer=wrapper, cache=None, cache_mode="", vision=None, no_images="")


def chat(messages: list, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER, TIME], **fields)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_is_generated_as_the_template_writes_it_back(tokenizer, choice):
    hf, _ = tokenizer
    engine = fake_engine(hf)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    plan = plan_tools(chat(user, tool_choice=choice), engine)
    assert plan.mode == "forced" and plan.templated and plan.tools == [WEATHER, TIME]
    prompt = render(engine, chat(user, tool_choice=choice), plan)
    assert hf.decode(prompt).endswith("<|start|>assistant")  # the template's own prompt

    run = Driver(tokenizer, plan.grammar)
    generated = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "'
    run.write(generated)
    assert not run.allows("\n")
    run.write('Paris", "unit": "c"}<|call|>')
    assert run.allowed == {0}  # the call is whole: only the end
    text = hf.decode(run.tokens)

    reasoning, content, calls = Reply(engine, chat(user), plan).whole_all(text)
    assert reasoning is None and content is None
    ((call,),) = [calls]
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "unit": "c"}'  # as generated

    # The next turn, as a client sends it back: the call is in its prompt token for token.
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21C"}
    after = render(engine, chat([*user, turn, result]), plan_tools(chat([*user, turn]), engine))
    assert after[: len(prompt) + len(run.tokens)] == prompt + run.tokens


def test_the_grammar_holds_the_arguments_to_the_schema_and_the_template_json(tokenizer):
    run = Driver(tokenizer, harmony.forced_call_grammar([WEATHER]))
    run.write(" to=functions.get_")
    assert run.allows("w") and not run.allows("t")  # only the tool asked for
    run.write('weather<|channel|>commentary json<|message|>{"city":')
    assert not run.allows('"') and run.allows(" ")  # tojson's ": "
    run.write(' "Rome", "unit": "')
    assert run.allows("f") and not run.allows("k")


def test_history_renders_thinking_before_a_call_and_drops_it_after_an_answer(tokenizer):
    hf, _ = tokenizer
    engine = fake_engine(hf)
    arguments = '{"city": "Rome", "unit": "c"}'
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Need weather.",
            "tool_calls": [call],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    text = hf.decode(render(engine, chat(messages), plan_tools(chat(messages), engine)))
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Rome", "unit": "c"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny"<|end|>'
        "<|start|>assistant"
    )
    answered = [*messages, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Ok."},
                {"role": "user", "content": "Thanks"}]  # fmt: skip
    text = hf.decode(render(engine, chat(answered), plan_tools(chat(answered), engine)))
    assert "Need weather." not in text and "Ok." not in text  # the template drops both
    assert "<|channel|>final<|message|>Sunny.<|end|>" in text
