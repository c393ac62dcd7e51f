"""A streamed request whose model is still loading: its stream starts and is kept alive.

A model's first request waits for its load: seconds for weights read from disk, minutes
for a download or a GGUF's import. A client reading a stream, or a proxy on the way, gives
up on a connection that sends nothing for long, which is why a stream sends keep-alives
while its prompt prefills (`serving.sse`). A streamed request whose model is not ready
within `LOAD_GRACE` gets its response at once: its API's keep-alive every
`KEEP_ALIVE_EVERY` seconds while the model loads, then the stream as it would have come.
Once the response has started its status is sent, so what fails after that (the load,
or the request's own checks, which need the model's tokenizer) comes as the API's error
event, which the official SDKs raise. Within the grace nothing changes: every error
keeps its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from ..serving.errors import APIError, error_body
from ..serving.sse import KEEP_ALIVE, KEEP_ALIVE_EVERY, SSE_DONE, EventStream
from .errors import shaped
from .loader import ServedModel
from .state import ServerState

log = logging.getLogger("mlx_cache_server.errors")

LOAD_GRACE = KEEP_ALIVE_EVERY  # seconds a stream waits for its model before it starts

Answer = Callable[[ServedModel], Awaitable[Any]]


@dataclass(frozen=True)
class StreamShape:
    """How an API's stream says "still here" and "failed" (from an OpenAI-shaped body)."""

    keep_alive: str
    error: Callable[[int, dict[str, Any]], str]


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _responses_error(status: int, body: dict[str, Any]) -> str:
    error = body["error"]
    data = {"type": "error", "sequence_number": 0, "code": error["code"] or error["type"],
            "message": error["message"], "param": error["param"]}  # fmt: skip
    return _event("error", data)


OPENAI = StreamShape(KEEP_ALIVE, lambda status, body: f"data: {json.dumps(body)}\n\n{SSE_DONE}")
ANTHROPIC = StreamShape(
    _event("ping", {"type": "ping"}),
    lambda status, body: _event("error", shaped("/v1/messages", status, body)),
)
RESPONSES = StreamShape(KEEP_ALIVE, _responses_error)


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
        return EventStream(_loading(entering, lease, answer, stream))
    served = entering.result()  # the pool's refusals: the API's errors, with their status
    async with lease:
        return await answer(served)


async def _loading(
    entering: asyncio.Future, lease: contextlib.AsyncExitStack, answer: Answer, shape: StreamShape
) -> AsyncIterator[str]:
    try:
        yield shape.keep_alive  # bytes at once: the grace is over
        while not entering.done():
            await asyncio.wait({entering}, timeout=KEEP_ALIVE_EVERY)
            if not entering.done():
                yield shape.keep_alive
        try:
            served = entering.result()
            async with lease:  # held while the request starts, as a route holds it
                response = await answer(served)
        except APIError as e:
            yield shape.error(e.status, error_body(e.message, e.type, e.param, e.code))
            return
        except Exception:
            request_id = f"req-{uuid.uuid4().hex[:16]}"
            log.exception("unhandled error (request id %s)", request_id)
            message = (
                f"The server had an error while processing your request (request id "
                f"{request_id}). Retry; if it persists, report the request id."
            )
            yield shape.error(500, error_body(message, "server_error"))
            return
        if not isinstance(response, StreamingResponse):  # a surface answered a stream whole
            raise TypeError(f"a streamed request was answered with {type(response).__name__}")
        body = response.body_iterator
        async with contextlib.aclosing(body):  # type: ignore[type-var]
            async for chunk in body:
                yield chunk
    finally:
        await _settle(entering, lease)


async def _settle(entering: asyncio.Future, lease: contextlib.AsyncExitStack) -> None:
    """The wait for the model over: cancelled if it still waits, its lease released if it
    was given one and nobody took it."""
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
