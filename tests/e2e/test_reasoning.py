"""A reasoning model's thinking comes back in `reasoning_content`, never in `content`; sent
back, it keeps the next turn's prompt on the cache. Through the `openai` SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from openai import OpenAI

from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.settings import Settings
from tests.live import LiveServer
from tests.tiny_model import THINK_CHATML, build_tiny_model

THOUGHT, ANSWER = "I think.", "Hello!"


class Scripted:
    """The model with its greedy choice forced to a script: a reply known in advance (the
    random tiny model would never close its thinking). The script restarts at every
    prefill of more than one token, so each request (whose prompt is not all cached
    already) gets the script as its reply."""

    def __init__(self, model: Any, script: list[int]) -> None:
        self.model, self.script, self.step = model, script, 0

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        logits = self.model(inputs, *args, **kwargs)
        self.step = 0 if inputs.shape[1] > 1 else self.step + 1
        token = self.script[min(self.step, len(self.script) - 1)]
        return logits + (mx.arange(logits.shape[-1]) == token) * 1e4

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = build_tiny_model(
        Path(tmp_path_factory.mktemp("tiny-think")), chat_template=THINK_CHATML, thinking=True
    )
    # Without speculation: a verification pass of several positions would restart the script.
    settings = Settings(served_model_name="tiny", speculation=False)
    engine = build_engine(settings, str(folder))
    # The prompt opens the thinking; the model closes it, answers, and ends its turn.
    reply = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    engine.model = Scripted(engine.model, [*engine.tokenizer.encode(reply), 99])  # 99: im_end
    server = LiveServer(engine, settings).start()
    yield server
    server.stop()


def client(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_thinking_is_reasoning_content_not_content(live):
    r = client(live).chat.completions.create(model="tiny", messages=ask("Hi."), max_tokens=40)
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == THOUGHT
    assert r.choices[0].finish_reason == "stop"


def test_streamed_thinking_arrives_in_reasoning_content_deltas(live):
    stream = client(live).chat.completions.create(
        model="tiny", messages=ask("Hello?"), max_tokens=40, stream=True
    )
    thought, content, order = "", "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            thought += delta.reasoning_content
            order.append("reasoning")
        if delta.content:
            content += delta.content
            order.append("content")
    assert (thought, content) == (THOUGHT, ANSWER)
    assert order.index("content") > max(i for i, kind in enumerate(order) if kind == "reasoning")


def test_reasoning_sent_back_keeps_the_next_turn_on_the_cache(live):
    question = ask("Say hello.")
    first = client(live).chat.completions.create(model="tiny", messages=question, max_tokens=40)
    said = first.choices[0].message
    reused = {}
    for sent_back in (True, False):
        turn = {"role": "assistant", "content": said.content}
        if sent_back:
            turn["reasoning_content"] = said.reasoning_content
        messages = [*question, turn, {"role": "user", "content": "And again?"}]
        r = client(live).chat.completions.create(model="tiny", messages=messages, max_tokens=40)
        reused[sent_back] = r.usage.prompt_tokens_details.cached_tokens
    # Written back by the template, the thinking is the tokens that were generated.
    assert reused[True] >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    # Left out, the prompt parts from the cache where the assistant's turn begins.
    assert reused[False] < first.usage.prompt_tokens


def test_streamed_logprobs_go_with_the_part_their_tokens_made(live):
    stream = client(live).chat.completions.create(
        model="tiny", messages=ask("Good day?"), max_tokens=40, stream=True, logprobs=True
    )
    parts = {"reasoning": ["", ""], "content": ["", ""]}  # text, the logprobs' tokens
    for chunk in stream:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        choice = chunk.choices[0]
        thought = getattr(choice.delta, "reasoning_content", None)
        part = "content" if thought is None else "reasoning"
        parts[part][0] += thought if thought is not None else choice.delta.content
        parts[part][1] += "".join(t.token for t in choice.logprobs.content)
    # The newline cut from the thinking's end was still written while thinking; the closing
    # tag and the newlines after it are no part's text, and come with the answer.
    assert parts["reasoning"] == [THOUGHT, THOUGHT + "\n"]
    assert parts["content"] == [ANSWER, "</think>\n\n" + ANSWER]


def anthropic_client(live):
    from anthropic import Anthropic

    return Anthropic(base_url=live.url, api_key="unused", max_retries=0)


def test_anthropic_thinking_blocks_whole_streamed_and_sent_back(live):
    client = anthropic_client(live)
    question = [{"role": "user", "content": "Greetings?"}]
    whole = client.messages.create(model="tiny", max_tokens=40, messages=question)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert (whole.content[0].thinking, whole.content[1].text) == (THOUGHT, ANSWER)
    with client.messages.stream(
        model="tiny", max_tokens=40, messages=[{"role": "user", "content": "Hey?"}]
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (THOUGHT, ANSWER)
    assert (
        kinds.index("text_delta") > kinds.index("signature_delta") > kinds.index("thinking_delta")
    )
    # Sent back as Claude Code does, the thinking block keeps the next turn on the cache.
    said = [b.model_dump(exclude_none=True) for b in whole.content]
    again = [
        *question,
        {"role": "assistant", "content": said},
        {"role": "user", "content": "More?"},
    ]
    r = client.messages.create(model="tiny", max_tokens=40, messages=again)
    first = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert r.usage.cache_read_input_tokens >= first + whole.usage.output_tokens - 1


def test_responses_reasoning_items_whole_streamed_and_sent_back(live):
    openai = client(live)
    first = openai.responses.create(model="tiny", input="Salutations?", max_output_tokens=40)
    assert [item.type for item in first.output] == ["reasoning", "message"]
    assert first.output[0].content[0].text == THOUGHT and first.output_text == ANSWER
    with openai.responses.stream(model="tiny", input="Howdy?", max_output_tokens=40) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # Sent back as Codex does (the output items as they came), the next turn stays cached.
    again = [
        {"role": "user", "content": "Salutations?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "More?"},
    ]
    r = openai.responses.create(model="tiny", input=again, max_output_tokens=40)
    cached = r.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1


def test_a_reply_cut_while_thinking_is_an_incomplete_reasoning_item(live):
    openai = client(live)
    whole = openai.responses.create(model="tiny", input="Yo?", max_output_tokens=4)
    with openai.responses.stream(model="tiny", input="Hiya?", max_output_tokens=4) as stream:
        # The SDK's get_final_response() wants response.completed; this ends incomplete.
        (streamed,) = [e.response for e in stream if e.type == "response.incomplete"]
    for r in (whole, streamed):
        assert r.status == "incomplete"
        assert [(item.type, item.status) for item in r.output] == [("reasoning", "incomplete")]
