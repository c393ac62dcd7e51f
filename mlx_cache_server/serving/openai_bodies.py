"""Request and response bodies, in OpenAI's wire format.

Unknown request fields are accepted and ignored, as OpenAI clients send many;
known fields are type-checked strictly and a wrong one is a 400 naming it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator


class _Request(BaseModel):
    # Strict as OpenAI is: `max_tokens: true` or `stream: "yes"` is a 400, not a coercion.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # OpenAI takes null for any optional field as "not given", and clients send it.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An assistant turn's thinking, sent back (vLLM's name; mlx_lm.server's "reasoning").
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(_Request):
    include_usage: bool = False


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(value: Any) -> bool:
    # Without recursion: a body nested deeper than Python's recursion limit is checked too.
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v) is not None:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


class TextRequest(_Request):
    """A whole request body (of any API), checked once for text no tokenizer takes."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON may escape a lone UTF-16 surrogate ("\ud800"); no tokenizer or encoder takes it.
        if _has_surrogate(data):
            raise ValueError(
                "the request contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                "which is not text; send valid Unicode"
            )
        return data


class SamplingFields(TextRequest):
    """What chat and text completion requests share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # Left out (or null): the server's defaults (`SamplingDefaults`), not OpenAI's 1.0.
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Accepted for OpenAI clients that send it, and ignored: the cache matches by content,
    # so requests share whatever prefix they share, key or not. Tenants are kept apart by
    # API keys, not by this hint.
    prompt_cache_key: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1)


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's thinking, never in content
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends only what a delta adds: the last chunk's delta is {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class _UsageWhenAsked(BaseModel):
    """A stream chunk: "usage" appears (null until the last chunk) only when it was asked
    for with stream_options.include_usage, i.e. only when set."""

    @model_serializer(mode="wrap")
    def _usage_when_set(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if "usage" not in self.model_fields_set:
            out.pop("usage", None)
        return out


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_UsageWhenAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(_UsageWhenAsked):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-cache-server"
    # Beyond OpenAI's card, as local servers report it (LM Studio's `state`, say):
    # embedding: for POST /v1/embeddings only; None: not known until its files are fetched
    type: Literal["chat", "embedding"] | None = "chat"
    status: Literal["loaded", "loading", "unloaded"] = "loaded"
    loaded: bool = True
    context_length: int | None = None  # None: not known until it is loaded
    aliases: list[str] = []  # other names requests may use for it
    pinned: bool = False  # loaded at start and never unloaded
    ttl: float | None = None  # idle seconds before it is unloaded
    memory_bytes: int = 0  # what it counts against --memory-budget (estimated until loaded)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    model: str  # the default model
    running: int  # over every loaded model
    waiting: int
    models: dict[str, Literal["loaded", "loading", "unloaded"]] = {}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
