"""One generation as a handler runs it: off the event loop, under a deadline, recorded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from ..engine import Delta, Engine, Event, Failed, Finished, SamplingParams, Started, TokenLogprob
from ..settings import Settings
from .api_errors import APIError
from .defaults import SamplingDefaults
from .limits import Slot
from .metrics import Metrics
from .openai_bodies import PromptTokensDetails, Usage
from .workers import GRAMMARS, TEMPLATING

request_log = logging.getLogger("mlx_cache_server.requests")
T = TypeVar("T")


@dataclass(eq=False)
class Surface:
    """What a serving class works with: the engine, and the server's rules for requests."""

    engine: Engine
    settings: Settings
    metrics: Metrics
    # Names a request may use for the served model (`ModelNames`: with `--answer-any-model`
    # the default model's take any name no model has).
    aliases: Container[str]
    defaults: SamplingDefaults  # sampling for what a request leaves out


@dataclass
class RequestContext:
    """Who asked for what: for logs, metrics, and the tenant's cache namespace."""

    id: str
    route: str
    model: str
    tenant: str | None


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a templating thread: tokenizing and templating a long prompt takes
    long enough to stall every other client's stream if run on the event loop."""
    return await TEMPLATING.run(fn, *args)


async def compiling(fn: Callable[..., T], *args: Any, param: str | None = None) -> T:
    """`fn(*args)` on a grammar thread: a client's schema or grammar compiled."""
    return await GRAMMARS.run(fn, *args, param=param)


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
        gone = not task.done()
        if gone:
            task.cancel()
    if gone:
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its generation is cancelled on the way out
        raise APIError(499, "The client closed the connection.", code="client_closed")
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Result:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_sequence: str | None = None

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
    timeout: float,
    metrics: Metrics,
    slot: Slot,
) -> AsyncIterator[Event]:
    """The engine's events for one request, under its deadline, recorded when it ends.

    Past the deadline the generation is cancelled and a 408 `Failed` ends the stream.
    The request's slot is freed when it ends.
    """
    t0 = time.perf_counter()
    deadline = t0 + timeout
    first = started = finished = None
    generated = 0  # tokens so far: logged for a request that never finishes
    events = engine.stream(tokens, params, ctx.tenant)
    try:
        while True:
            try:
                # Not `wait_for`: on Python 3.11 it drops a cancellation that arrives as
                # the next event is ready, and a gone client's generation runs to its end.
                async with asyncio.timeout(deadline - time.perf_counter()):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                finished = Failed(
                    f"The request took longer than {timeout:g}s and was stopped.", "timeout"
                )
                yield finished
                return
            if isinstance(event, Started):
                started = event
            elif isinstance(event, Delta):
                first = time.perf_counter() if first is None else first
                generated = event.generated
            elif isinstance(event, Failed):
                # The id in the message is the one in the log's line for this request.
                event = Failed(f"{event.message} (request id {ctx.id})", event.reason)
                finished = event
            elif isinstance(event, Finished):
                finished = event
            yield event
    finally:
        slot.release()
        await events.aclose()
        _record(ctx, metrics, t0, first, started, finished, generated)


def _record(ctx, metrics, t0, first, started, finished, generated) -> None:
    total = time.perf_counter() - t0
    prompt = started.prompt_tokens if started else 0
    cached = started.cached_tokens if started else 0
    completion = finished.completion_tokens if isinstance(finished, Finished) else generated
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
    record = {
        "event": "request",
        "id": ctx.id,
        "route": ctx.route,
        "model": ctx.model,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        # From the engine's intake: waiting to be admitted, then to the first token.
        "queued_ms": round((started.admitted_at - t0) * 1000, 1) if started else None,
        "ttft_ms": round((first - t0) * 1000, 1) if first is not None else None,
        "total_ms": round(total * 1000, 1),
        "finish_reason": reason,
        # Prompt-lookup draft tokens verified, and accepted (`engine.speculative`).
        "drafted": finished.drafted if isinstance(finished, Finished) else 0,
        "accepted": finished.accepted if isinstance(finished, Finished) else 0,
    }
    request_log.info(json.dumps(record))
    metrics.recent.append({**record, "tenant": ctx.tenant, "ended": time.time()})


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
            result.stop_sequence = event.stop_sequence
        elif isinstance(event, Failed):
            status, kind = failure_status(event)
            raise APIError(status, event.message, type=kind)
    return result


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def failure_status(event: Failed) -> tuple[int, str]:
    """A failed generation's HTTP status and OpenAI error type."""
    return {
        "timeout": (408, "timeout_error"),
        "shutdown": (503, "service_unavailable"),
        # The request's grammar, past what the grammar engine can follow: the client's to fix.
        "grammar": (400, "invalid_request_error"),
    }.get(event.reason, (500, "server_error"))


async def with_pauses(events: AsyncIterator[Event], every: float) -> AsyncIterator[Event | None]:
    """The events, and None whenever `every` seconds pass without one: a stream's cue to
    send something that keeps clients and proxies from giving up on a long prefill."""
    pending = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(events))
    finally:
        if not pending.done():
            pending.cancel()
            try:
                await pending  # the generator must be idle before it can be closed
            except (asyncio.CancelledError, StopAsyncIteration):
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    await events.aclose()
                    raise  # our own cancellation, not only the pending read's
        await events.aclose()
