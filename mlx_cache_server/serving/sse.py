"""Server-sent events in OpenAI's streaming format, built from the chunk schemas."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..engine import Delta, Event, Failed, Finished, Started
from .api_errors import error_body
from .generation import failure_status, make_usage, with_pauses
from .openai_bodies import ErrorResponse, Usage

SSE_DONE = "data: [DONE]\n\n"
# An SSE comment, which clients skip: sent while a long prompt prefills, so that clients
# and proxies with idle timeouts keep the stream.
KEEP_ALIVE = ": keep-alive\n\n"
KEEP_ALIVE_EVERY = 5.0  # seconds without an event before one


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


Chunks = list[BaseModel]


async def sse_stream(
    events: AsyncIterator[Event],
    *,
    start: Callable[[], Chunks],
    delta: Callable[[Delta], Chunks],
    finish: Callable[[str], Chunks],
    usage: Callable[[Usage], BaseModel] | None,
) -> AsyncIterator[str]:
    """One stream's events as SSE; the callables build the surface's chunks (any number).

    `usage`, when the client asked for it, builds the last chunk; `data: [DONE]`
    ends the stream, errors included (an error event in OpenAI's error shape).
    """
    prompt = cached = 0
    async with contextlib.aclosing(with_pauses(events, KEEP_ALIVE_EVERY)) as paced:
        async for event in paced:
            if event is None:
                yield KEEP_ALIVE
            elif isinstance(event, Started):
                prompt, cached = event.prompt_tokens, event.cached_tokens
                for chunk in start():
                    yield sse(chunk)
            elif isinstance(event, Delta):
                for chunk in delta(event):
                    yield sse(chunk)
            elif isinstance(event, Finished):
                for chunk in finish(event.reason):
                    yield sse(chunk)
                if usage is not None:
                    yield sse(usage(make_usage(prompt, cached, event.completion_tokens)))
                yield SSE_DONE
                return
            elif isinstance(event, Failed):
                _, kind = failure_status(event)
                yield sse(ErrorResponse.model_validate(error_body(event.message, kind)))
                yield SSE_DONE
                return


class EventStream(StreamingResponse):
    """A streaming response that always closes its body, so the generation behind it ends.

    Starlette leaves the body iterator suspended when sending fails (a client
    that stopped reading, see `server.connections.GuardedH11`); until garbage
    collection found it, its generation would run on.
    """

    def __init__(self, body: AsyncIterator[str]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
