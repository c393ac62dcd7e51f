"""OpenAI wire translation alone: request checks, messages, stream chunks, error shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from mlx_cache_server.engine import SamplingParams
from mlx_cache_server.server.error_handlers import _param
from mlx_cache_server.serving.api_errors import APIError
from mlx_cache_server.serving.defaults import SamplingDefaults
from mlx_cache_server.serving.limits import check_prompt_chars, sampling_params
from mlx_cache_server.serving.openai_bodies import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    ChunkDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from mlx_cache_server.serving.template import template_message as _message
from mlx_cache_server.settings import Settings

ENGINE = SimpleNamespace(context_length=100, vocab_size=50, max_token_chars=4)
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, **fields)


def params(req, prompt_tokens=10, max_tokens=None) -> SamplingParams:
    return sampling_params(
        req,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        logprobs=None,
        engine=ENGINE,
        settings=Settings(default_max_tokens=20, max_tokens_cap=60),
        defaults=SamplingDefaults(temperature=0.7),
        prompt_param="messages",
    )


def refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kwargs)
    return e.value


def test_what_a_request_leaves_out_takes_the_servers_defaults():
    p = params(chat(top_p=0.5))
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.5, 0, 0.0)


def test_top_k_of_the_whole_vocabulary_filters_nothing():
    assert params(chat(top_k=50)).top_k == 0


def test_sampling_parameters_go_to_the_engine_as_given():
    p = params(chat(temperature=0.5, top_p=0.9, top_k=7, seed=3, stop="x", logit_bias={"4": 2}))
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (0.5, 0.9, 7, 3, ["x"])
    assert p.logit_bias == {4: 2.0} and p.max_tokens == 20  # the server's default


@pytest.mark.parametrize(
    ("fields", "max_tokens", "prompt_tokens", "param"),
    [
        ({"top_k": 51}, None, 10, "top_k"),  # past the vocabulary
        ({"n": 2}, None, 10, "n"),
        ({}, None, 100, "messages"),  # the prompt fills the context
        ({"logit_bias": {"50": 1}}, None, 10, "logit_bias"),
        ({"stop": [str(i) for i in range(17)]}, None, 10, "stop"),
    ],
)
def test_out_of_bounds_parameters_are_400s_naming_the_parameter(
    fields, max_tokens, prompt_tokens, param
):
    error = refused(params, chat(**fields), prompt_tokens, max_tokens)
    assert error.status == 400 and error.param == param


@pytest.mark.parametrize(
    ("max_tokens", "prompt_tokens", "lowered"),
    [(61, 10, 60), (50, 60, 40), (1000, 99, 1), (40, 60, 40)],
    ids=["past the server's cap", "past the context's room", "room for one", "fits"],
)
def test_max_tokens_past_what_fits_is_lowered_to_it(max_tokens, prompt_tokens, lowered):
    assert params(chat(), prompt_tokens, max_tokens).max_tokens == lowered


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": True},
        {"max_tokens": 5.0},
        {"stream": "yes"},
        {"temperature": "1"},
        {"seed": -1},
        {"seed": 2**64},
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"model": "x\udfff"},
    ],
)
def test_requests_are_typed_strictly_and_must_be_text(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **fields})


def test_a_prompt_too_long_for_any_tokenization_is_refused_by_its_length():
    check_prompt_chars(2 * 100 * 4, ENGINE, "prompt")  # could still fit
    error = refused(check_prompt_chars, 2 * 100 * 4 + 1, ENGINE, "prompt")
    assert error.code == "context_length_exceeded"


def test_chat_messages_become_template_messages():
    developer = ChatMessage(role="developer", content=[{"type": "text", "text": "a"}] * 2)
    assert _message(developer, 0) == {"role": "system", "content": "aa"}
    image = ChatMessage(role="user", content=[{"type": "image_url"}])
    assert refused(_message, image, 3).param == "messages[3].content[0]"


def test_stream_chunks_carry_usage_only_when_asked():
    def chunk(choice, **usage):
        return json.loads(
            ChatCompletionChunk(
                id="c", created=1, model="m", choices=[choice], **usage
            ).model_dump_json()
        )

    first = chunk(ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content="")))
    assert "usage" not in first and first["object"] == "chat.completion.chunk"
    assert first["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    last = chunk(ChunkChoice(index=0, delta=ChunkDelta(), finish_reason="stop"), usage=None)
    assert last["usage"] is None and last["choices"][0]["delta"] == {}
    usage = Usage(
        prompt_tokens=3,
        completion_tokens=2,
        total_tokens=5,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
    )
    text = CompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[CompletionChoice(index=0, text="x", finish_reason=None)],
    )
    assert "usage" not in json.loads(text.model_dump_json())
    text.usage = usage
    assert json.loads(text.model_dump_json())["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 1
    }


def test_validation_errors_name_the_parameter_as_openai_does():
    assert (
        _param(("body", "messages", 0, "content", "list[TextPart]", 1)) == "messages[0].content[1]"
    )
    assert _param(("body", "stream_options", "include_usage")) == "stream_options.include_usage"


def test_completion_prompts_may_be_text_or_tokens():
    for prompt in ("a", ["a"], [1, 2], [[1, 2]]):
        assert CompletionRequest(model="m", prompt=prompt).prompt == prompt
