"""The server's own tool protocol for templates without tools: the lazy grammar token by
token on the tiny tokenizer, the markup read back, and the history rendered as generated."""

from __future__ import annotations

import json
from types import SimpleNamespace

import llguidance
import llguidance.hf
import mlx.core as mx
import pytest
from transformers import PreTrainedTokenizerFast

from mlx_cache_server.engine.constraint import GrammarProcessor
from mlx_cache_server.serving import prompted_tools
from mlx_cache_server.serving.tools import ToolCallText
from tests.tiny_model import build_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=0)


class Driver:
    """A GrammarProcessor fed text as the engine feeds it sampled tokens."""

    def __init__(self, tokenizer, grammar: str) -> None:
        self.hf, lt = tokenizer
        self.processor = GrammarProcessor(lt, grammar)
        self.tokens: list[int] = []
        self.allowed = self._step()

    def _step(self) -> set[int]:
        logits = mx.zeros((1, len(self.hf)))
        out = self.processor(mx.array(self.tokens), logits)
        return {i for i, v in enumerate(out[0].tolist()) if v != float("-inf")}

    def write(self, text: str) -> None:
        for token in self.hf.encode(text, add_special_tokens=False):
            assert token in self.allowed, (text, self.hf.decode(self.tokens))
            self.tokens.append(token)
            self.allowed = self._step()

    def allows(self, text: str) -> bool:
        return self.hf.encode(text, add_special_tokens=False)[0] in self.allowed


def test_free_text_until_the_model_opens_a_call_then_only_a_valid_call(tokenizer):
    grammar = prompted_tools.lazy_grammar([WEATHER])
    run = Driver(tokenizer, grammar)
    assert run.allows("H") and run.allows("{") and 0 in run.allowed  # anything, or the end
    run.write("Let me look. ")
    run.write("<tool_call>\n")
    assert not run.allows("H") and 0 not in run.allowed  # inside a call: only its JSON
    run.write('{"name":"get_weather","arguments":{"city":"')
    assert run.allows("P") and run.allows("R") and not run.allows("L")  # the schema's enum
    run.write('Paris"}}')
    assert not run.allows("}") and run.allows("\n")  # the call is whole: its end marker
    run.write("\n</tool_call>")
    assert run.allows("O") and 0 in run.allowed  # free again
    text = run.hf.decode(run.tokens)
    reader = ToolCallText(SimpleNamespace(tokenizer=None), [WEATHER], prompted=True)
    content, calls = reader.feed(text)
    rest, more = reader.finish()
    assert content + rest == "Let me look. "
    ((call,),) = [calls + more]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_an_unknown_tool_name_is_never_generated(tokenizer):
    run = Driver(tokenizer, prompted_tools.lazy_grammar([WEATHER]))
    run.write('<tool_call>\n{"name":"')
    assert run.allows("g") and not run.allows("x")


def test_history_renders_calls_and_results_as_the_model_wrote_them():
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
        {"role": "user", "content": "Thanks."},
    ]
    out = prompted_tools.history(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("# Tools") and out[0]["content"].endswith(
        "</tool_call>\n\nBe brief."
    )  # the tools first: a change in the system text keeps their KV
    assert json.dumps(WEATHER, separators=(",", ":")) in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\nSunny.\n</tool_response>\nThanks."
    assert "tool_calls" not in out[2] and messages[2]["tool_calls"] == [call]  # not mutated
