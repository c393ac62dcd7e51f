"""Server-sent events in OpenAI's streaming format, built from the chunk schemas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..engine import Delta, Event, Failed, Finished, Started
from .errors import error_body
from .generation import failure_status, make_usage
from .schemas import ErrorResponse, Usage

SSE_DONE = "data: [DONE]\n\n"


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
    async for event in events:
        if isinstance(event, Started):
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
        elif isinstance(event, Failed):
            _, kind = failure_status(event)
            yield sse(ErrorResponse.model_validate(error_body(event.message, kind)))
            yield SSE_DONE


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
