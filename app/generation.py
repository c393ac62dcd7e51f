"""What chat and text completions share: checks, engine parameters, results, SSE."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .engine import Delta, Engine, Failed, Finished, SamplingParams, Started, TokenLogprob
from .errors import APIError, error_body
from .schemas import PromptTokensDetails, Usage, _Sampling


@dataclass
class Limits:
    """Server-side bounds a request is checked against."""

    max_tokens_cap: int = 32768
    default_max_tokens: int = 2048
    max_stop_sequences: int = 16


def check_model(name: str, engine: Engine, aliases: set[str]) -> None:
    if name not in aliases:
        raise APIError(
            404,
            f"The model '{name}' does not exist. This server serves '{engine.model_id}'; "
            "list models with GET /v1/models.",
            param="model",
            code="model_not_found",
        )


def sampling_params(
    req: _Sampling,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    logprobs: int | None,
    engine: Engine,
    limits: Limits,
    prompt_param: str,
) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, "Only n=1 is supported; send several requests instead.", param="n")
    room = engine.context_length - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(room, limits.default_max_tokens)
    elif max_tokens > limits.max_tokens_cap:
        raise APIError(
            400,
            f"max_tokens is too large: {max_tokens}. This server allows at most "
            f"{limits.max_tokens_cap}.",
            param="max_tokens",
        )
    elif max_tokens > room:
        raise APIError(
            400,
            f"max_tokens is too large: the prompt has {prompt_tokens} tokens and this model's "
            f"context is {engine.context_length}, which leaves room for {room}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_sequences:
        raise APIError(
            400, f"At most {limits.max_stop_sequences} stop sequences are allowed.", param="stop"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop=stop,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias, engine.vocab_size),
        logprobs=logprobs,
    )


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise APIError(
                400,
                f"logit_bias keys must be token ids in [0, {vocab}); got {key!r}.",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise APIError(400, "logit_bias values must be in [-100, 100].", param="logit_bias")
        out[token] = value
    return out


@dataclass
class Result:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.cached_tokens, self.completion_tokens)


def make_usage(prompt: int, cached: int, completion: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def collect(engine: Engine, tokens: list[int], params: SamplingParams) -> Result:
    result = Result()
    async for event in engine.stream(tokens, params):
        if isinstance(event, Started):
            result.prompt_tokens, result.cached_tokens = event.prompt_tokens, event.cached_tokens
        elif isinstance(event, Delta):
            result.text += event.text
            result.logprobs += event.logprobs
        elif isinstance(event, Finished):
            result.finish_reason = event.reason
            result.completion_tokens = event.completion_tokens
        elif isinstance(event, Failed):
            raise APIError(500, event.message, type="server_error")
    return result


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_error(message: str) -> AsyncIterator[str]:
    yield sse(error_body(message, "server_error"))
