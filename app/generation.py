"""What chat and text completions share: checks, engine parameters, results, SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from .engine import Delta, Engine, Event, Failed, Finished, SamplingParams, Started, TokenLogprob
from .errors import APIError, error_body
from .metrics import Metrics
from .schemas import PromptTokensDetails, Usage, _Sampling

request_log = logging.getLogger("mlx_cache_server.requests")
T = TypeVar("T")


@dataclass
class Limits:
    """Server-side bounds a request is checked against."""

    max_tokens_cap: int = 32768
    default_max_tokens: int = 2048
    max_stop_sequences: int = 16
    max_messages: int = 1024
    max_queue: int = 256
    request_timeout: float = 600.0


@dataclass
class RequestContext:
    """Who asked for what: for logs, metrics, and the tenant's cache namespace."""

    id: str
    route: str
    model: str
    tenant: str | None


class Slot:
    """A request's place in the server's capacity (`Engine.in_flight`), from admission to end.

    Taken before the prompt is tokenized, so requests that arrive together are
    counted together. Freed once: by `tracked` when the request ends, by the
    handler when it fails before generating, or when the slot is dropped unused
    (a streaming response whose client left before it started).
    """

    def __init__(self, engine: Engine) -> None:
        engine.in_flight += 1
        self.release = weakref.finalize(self, _free_slot, engine)


def _free_slot(engine: Engine) -> None:
    engine.in_flight -= 1


def reserve_slot(engine: Engine, limits: Limits) -> Slot:
    if engine.in_flight >= engine.completion_batch_size + limits.max_queue:
        raise APIError(
            429,
            f"The server is busy: {engine.in_flight} requests are in flight. Retry shortly.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return Slot(engine)


def check_prompt_chars(chars: int, engine: Engine, param: str) -> None:
    """Refuse, before tokenizing it, a prompt that cannot fit the context whatever its tokens.

    No token stands for more characters than the longest in the vocabulary, so
    past `context_length` times that many characters the prompt is too long; the
    factor 2 leaves room for normalizers that fold several characters into one.
    Tokenizing a body of megabytes takes seconds that this check does not.
    """
    if chars > 2 * engine.context_length * engine.max_token_chars:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.context_length} tokens, and "
            f"the prompt's {chars} characters are far more than that. Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread: tokenizing and templating a long prompt takes long
    enough to stall every other client's stream if run on the event loop."""
    return await asyncio.to_thread(fn, *args)


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; if the client leaves first, `work` (and its generation) is cancelled.

    Streams notice a gone client when a write fails; a request waiting for its
    whole answer writes nothing until the end, so it listens for the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled():
        return await task
    raise APIError(499, "The client closed the connection.", code="client_closed")


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
    if req.top_k > engine.vocab_size:
        raise APIError(
            400,
            f"top_k must be at most the vocabulary size, {engine.vocab_size}; got {req.top_k}.",
            param="top_k",
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


async def tracked(
    engine: Engine,
    tokens: list[int],
    params: SamplingParams,
    ctx: RequestContext,
    limits: Limits,
    metrics: Metrics,
    slot: Slot,
) -> AsyncIterator[Event]:
    """The engine's events for one request, under its deadline, recorded when it ends.

    Past the deadline the generation is cancelled and a 408 `Failed` ends the stream.
    The request's slot is freed when it ends.
    """
    t0 = time.perf_counter()
    deadline = t0 + limits.request_timeout
    first = started = finished = None
    events = engine.stream(tokens, params, ctx.tenant)
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(events), deadline - time.perf_counter())
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                finished = Failed(
                    f"The request took longer than {limits.request_timeout:g}s and was stopped.",
                    status=408,
                    type="timeout_error",
                )
                yield finished
                return
            if isinstance(event, Started):
                started = event
            elif isinstance(event, Delta) and first is None:
                first = time.perf_counter()
            elif isinstance(event, Finished | Failed):
                finished = event
            yield event
    finally:
        slot.release()
        await events.aclose()
        _record(ctx, metrics, t0, first, started, finished)


def _record(ctx, metrics, t0, first, started, finished) -> None:
    total = time.perf_counter() - t0
    prompt = started.prompt_tokens if started else 0
    cached = started.cached_tokens if started else 0
    completion = finished.completion_tokens if isinstance(finished, Finished) else 0
    if isinstance(finished, Finished):
        reason = finished.reason
    else:
        reason = "error" if finished else "disconnected"
    if first is not None:
        metrics.ttft.labels(ctx.route).observe(first - t0)
    metrics.latency.labels(ctx.route).observe(total)
    metrics.prompt_tokens.inc(prompt)
    metrics.cached_tokens.inc(cached)
    metrics.completion_tokens.inc(completion)
    request_log.info(
        json.dumps(
            {
                "event": "request",
                "id": ctx.id,
                "route": ctx.route,
                "model": ctx.model,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": completion,
                "ttft_ms": round((first - t0) * 1000, 1) if first is not None else None,
                "total_ms": round(total * 1000, 1),
                "finish_reason": reason,
            }
        )
    )


async def collect(events: AsyncIterator[Event]) -> Result:
    result = Result()
    async for event in events:
        if isinstance(event, Started):
            result.prompt_tokens, result.cached_tokens = event.prompt_tokens, event.cached_tokens
        elif isinstance(event, Delta):
            result.text += event.text
            result.logprobs += event.logprobs
        elif isinstance(event, Finished):
            result.finish_reason = event.reason
            result.completion_tokens = event.completion_tokens
        elif isinstance(event, Failed):
            raise APIError(event.status, event.message, type=event.type)
    return result


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """A streaming response that always closes its body, so the generation behind it ends.

    Starlette leaves the body iterator suspended when sending fails (a client
    that stopped reading, see `WriteTimeout`); until garbage collection found it,
    its generation would run on.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return _EventStream(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def sse_failure(event: Failed) -> str:
    return sse(error_body(event.message, event.type))


async def sse_stream(
    events: AsyncIterator[Event],
    base: dict[str, Any],
    include_usage: bool,
    *,
    start: Callable[[], dict | None],
    delta: Callable[[Delta], dict],
    finish: Callable[[str], dict],
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; `start`, `delta` and `finish` make choices.

    With include_usage every chunk carries "usage": null and a last chunk with no
    choices carries the usage; `data: [DONE]` ends the stream, errors included.
    """

    def chunk(choice: dict) -> str:
        payload = {**base, "choices": [{"index": 0, **choice}]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    prompt = cached = 0
    async for event in events:
        if isinstance(event, Started):
            prompt, cached = event.prompt_tokens, event.cached_tokens
            first = start()
            if first is not None:
                yield chunk(first)
        elif isinstance(event, Delta):
            yield chunk(delta(event))
        elif isinstance(event, Finished):
            yield chunk(finish(event.reason))
            if include_usage:
                usage = make_usage(prompt, cached, event.completion_tokens)
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
            yield SSE_DONE
        elif isinstance(event, Failed):
            yield sse_failure(event)
            yield SSE_DONE
