"""A streamed request whose model is still loading: its stream starts and is kept alive.

A model's first request waits for its load: seconds for weights read from disk, minutes
for a download or a GGUF's import. A client reading a stream, or a proxy on the way, gives
up on a connection that sends nothing for long, which is why a stream sends keep-alives
while its prompt prefills (`serving.sse`). A streamed request whose model is not ready
within `LOAD_GRACE` gets its response at once: its API's keep-alive every
`KEEP_ALIVE_EVERY` seconds while the model loads, then the stream as it would have come.
Once the response has started its status (and headers, such as `Retry-After`) are sent,
so what fails after that (the load, the request's own checks, which need the model's
tokenizer, or the server stopping) comes as the API's error event, which the official
SDKs raise. Within the grace nothing changes: every error keeps its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..serving.api_errors import APIError, error_body
from ..serving.responses import ResponsesRequest, failed_stream
from ..serving.served_model import ServedModel
from ..serving.sse import KEEP_ALIVE, KEEP_ALIVE_EVERY, SSE_DONE, EventStream
from .error_handlers import logged_failure, shaped
from .state import ServerState

LOAD_GRACE = KEEP_ALIVE_EVERY  # seconds a stream waits for its model before it starts
STOP_POLL = 0.25  # seconds between looks at whether the server stops

Answer = Callable[[ServedModel], Awaitable[Any]]


@dataclass(frozen=True)
class StreamShape:
    """How an API's stream says "still here", and "failed" (from an OpenAI-shaped body)."""

    keep_alive: str
    error: Callable[[int, dict[str, Any]], str]


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n{SSE_DONE}"


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


OPENAI = StreamShape(KEEP_ALIVE, lambda status, body: _data(body))
ANTHROPIC = StreamShape(
    _event("ping", {"type": "ping"}),
    lambda status, body: _event("error", shaped("/v1/messages", status, body)),
)


def responses(req: ResponsesRequest) -> StreamShape:
    """The Responses API's: a failure is a response created and failed, as the SDK's stream
    helper expects of any stream."""

    def error(status: int, body: dict[str, Any]) -> str:
        e = body["error"]
        return failed_stream(req, e["code"] or e["type"], e["message"])

    return StreamShape(KEEP_ALIVE, error)


async def respond(
    state: ServerState, name: str, answer: Answer, stream: StreamShape | None = None
) -> Any:
    """`answer` with the model `name` names, loaded and held while it runs.

    `stream`: the request is streamed, in this API's shape; if its model is not ready
    within `LOAD_GRACE`, the response is a stream that keeps alive until it is.
    """
    if stream is None:
        async with state.model(name) as served:
            return await answer(served)
    lease = contextlib.AsyncExitStack()
    entering = asyncio.ensure_future(lease.enter_async_context(state.model(name)))
    try:
        await asyncio.wait({entering}, timeout=LOAD_GRACE)
    except BaseException:
        await _settle(entering, lease)
        raise
    if not entering.done():
        return EventStream(_WhileLoading(entering, lease, answer, stream, state))
    served = entering.result()  # the pool's refusals: the API's errors, with their status
    async with lease:
        return await answer(served)


class _WhileLoading:
    """The stream's body: `_loading`'s, and the wait for the model settled when it is
    closed, even if it never started (a generator that never ran skips its `finally`)."""

    def __init__(
        self,
        entering: asyncio.Future,
        lease: contextlib.AsyncExitStack,
        answer: Answer,
        shape: StreamShape,
        state: ServerState,
    ) -> None:
        self._entering, self._lease = entering, lease
        self._body = _loading(entering, lease, answer, shape, state)

    def __aiter__(self) -> _WhileLoading:
        return self

    async def __anext__(self) -> str:
        return await anext(self._body)

    async def aclose(self) -> None:
        try:
            await self._body.aclose()
        finally:
            await _settle(self._entering, self._lease)


async def _loading(
    entering: asyncio.Future,
    lease: contextlib.AsyncExitStack,
    answer: Answer,
    shape: StreamShape,
    state: ServerState,
) -> AsyncIterator[str]:
    yield shape.keep_alive  # bytes at once: the grace is over
    sent = time.monotonic()
    while not entering.done():
        if state.models.stopping.is_set():  # its shutdown grace over: end it properly
            yield shape.error(
                503, error_body("The server is shutting down.", "service_unavailable")
            )
            return
        await asyncio.wait({entering}, timeout=STOP_POLL)
        if not entering.done() and time.monotonic() - sent >= KEEP_ALIVE_EVERY:
            yield shape.keep_alive
            sent = time.monotonic()
    try:
        served = entering.result()
        async with lease:  # held while the request starts, as a route holds it
            response = await answer(served)
    except APIError as e:
        yield shape.error(e.status, error_body(e.message, e.type, e.param, e.code))
        return
    except Exception:
        yield shape.error(500, logged_failure()[0])
        return
    async with contextlib.aclosing(response.body_iterator) as body:
        async for chunk in body:
            yield chunk


async def _settle(entering: asyncio.Future, lease: contextlib.AsyncExitStack) -> None:
    """The wait for the model over: cancelled if it still waits, its lease released if it
    was given one and nobody took it. Idempotent."""
    if not entering.done():
        entering.cancel()
        try:
            await entering
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation, not only the wait's
        except Exception:
            pass  # the pool's refusal, for a request nobody answers any more
    if not entering.cancelled() and entering.exception() is None:
        await lease.aclose()  # a no-op if the request ran within it
