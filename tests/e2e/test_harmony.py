"""gpt-oss's harmony format through the `openai` SDK, on a tiny model under gpt-oss's real
chat template and harmony's special tokens: the analysis channel comes back as reasoning,
the final channel as content, a forced call as a call, and the next turn's prompt reuses
the call's tokens from the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.e2e.test_reasoning import Scripted
from tests.live import LiveServer
from tests.tiny_model import CHARS, SPECIAL, build_tiny_model, build_tokenizer
from tests.unit.test_harmony import HARMONY, TEMPLATE

THOUGHT, ANSWER = "User says hi.", "Hello!"
REPLY = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
)
CITY = {"type": "function", "function": {"name": "pick_city", "description": "Pick one.",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"]}}}  # fmt: skip


def build_harmony_model(path: Path) -> Path:
    """The tiny model with harmony's special tokens, gpt-oss's template, and its end tokens:
    `<|return|>` after an answer, `<|call|>` after a call."""
    special = SPECIAL + HARMONY
    build_tiny_model(path, chat_template=TEMPLATE, vocab_size=len(CHARS) + 1 + len(special))
    tokenizer = build_tokenizer(special)
    tokenizer.save(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "eos_token": "<|return|>"}))
    model_file = path / "config.json"
    ends = [tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")]
    model_file.write_text(json.dumps({**json.loads(model_file.read_text()), "eos_token_id": ends}))
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = build_harmony_model(Path(tmp_path_factory.mktemp("tiny-harmony")))
    settings = Settings(served_model_name="tiny", speculation=False)
    engine = build_engine(settings, str(folder))
    script = engine.tokenizer.encode(REPLY, add_special_tokens=False)
    engine.model = Scripted(
        engine.model, [*script, engine.tokenizer.convert_tokens_to_ids("<|return|>")]
    )
    server = LiveServer(engine, settings).start()
    yield server
    server.stop()


def client(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "Hi."}]


def test_analysis_is_reasoning_content_and_final_is_content(live):
    r = client(live).chat.completions.create(model="tiny", messages=USER, max_tokens=60)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    assert r.choices[0].finish_reason == "stop"


def test_streamed_deltas_split_the_same(live):
    stream = client(live).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there."}], max_tokens=60,
        stream=True,
    )  # fmt: skip
    thought, content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (thought, content) == (THOUGHT, ANSWER)


def test_a_forced_call_comes_back_as_a_call_and_its_tokens_are_reused(live):
    api = client(live)
    ask = [{"role": "user", "content": "Pick a city."}]
    r = api.chat.completions.create(
        model="tiny", messages=ask, tools=[CITY], tool_choice="required", max_tokens=60
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "pick_city"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    first = r.usage

    turn = {"role": "assistant", "content": None,
            "tool_calls": [call.model_dump(exclude_none=True)]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": call.id, "content": "Chosen."}
    r = api.chat.completions.create(
        model="tiny", messages=[*ask, turn, result], tools=[CITY], max_tokens=1
    )
    cached = r.usage.prompt_tokens_details.cached_tokens
    # The previous prompt and every token of the call, its `<|call|>` too.
    assert cached >= first.prompt_tokens + first.completion_tokens


def test_messages_gives_a_thinking_block_then_text_and_a_forced_tool_use(live):
    import anthropic

    api = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Hello."}]
    r = api.messages.create(model="tiny", messages=ask, max_tokens=60)
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content
    ] == [("thinking", THOUGHT), ("text", ANSWER)]
    again = [{"role": "user", "content": "Hello again."}]  # a new prompt: the script restarts
    with api.messages.stream(model="tiny", messages=again, max_tokens=60) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    tool = {"name": "pick_city", "description": "Pick one.",
            "input_schema": CITY["function"]["parameters"]}  # fmt: skip
    r = api.messages.create(model="tiny", messages=ask, max_tokens=60, tools=[tool],
                            tool_choice={"type": "any"})  # fmt: skip
    (use,) = r.content
    assert use.type == "tool_use" and use.input["city"] in ("Paris", "Rome")
    assert r.stop_reason == "tool_use"


def test_responses_gives_a_reasoning_item_then_the_message_and_a_forced_call(live):
    api = client(live)
    r = api.responses.create(model="tiny", input="Hey.", max_output_tokens=60)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    events = list(api.responses.create(model="tiny", input="Hey you.", max_output_tokens=60,
                                       stream=True))  # fmt: skip
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.output_text == ANSWER
    tool = {"type": "function", **CITY["function"]}
    r = api.responses.create(model="tiny", input="Pick.", tools=[tool], tool_choice="required",
                             max_output_tokens=60)  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
