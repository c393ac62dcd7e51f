"""The Responses API over a WebSocket (`GET /v1/responses` upgraded), the transport Codex CLI
tries first: what its messages say, and how the answer goes back on the socket.

The client sends `response.create` messages, each a Responses request body (`stream` is
implied) with `type` added; the server answers each with the events its SSE stream sends for
that request, in order, one event per text message. A request refused before its response
starts is one `error` event naming the HTTP status it would have had (Codex reads it as that
status); the socket stays open for the next.

A connection keeps its last response, whatever the request's `store` said, so the next one may
name it in `previous_response_id` and send only the new input: Codex does so on every turn
after the first, with `store: false`. Other ids are looked up among stored responses, as over
HTTP.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from .api_errors import APIError, error_body
from .response_store import ResponseStore
from .responses_input import ResponsesRequest

CREATE = "response.create"


def connection_memory() -> ResponseStore:
    """What a connection keeps of its responses: its last one, in memory."""
    return ResponseStore(max_entries=1)


def read_create(text: str | None) -> ResponsesRequest:
    """The request a client's message asks for, streamed; a 400 saying why it is none."""
    if text is None:
        raise APIError(400, "Send each event as a text message holding JSON.")
    try:
        event = json.loads(text)
    except ValueError:
        raise APIError(400, "The message is not valid JSON.") from None
    if not isinstance(event, dict) or event.get("type") != CREATE:
        kind = event.get("type") if isinstance(event, dict) else None
        raise APIError(
            400,
            f"Unsupported event type {kind!r}: this server answers '{CREATE}' events.",
            param="type",
            code="unsupported_event_type",
        )
    if event.get("background"):
        raise APIError(400, "background is not supported over a WebSocket.", param="background")
    body = {k: v for k, v in event.items() if k != "type"}
    try:
        return ResponsesRequest.model_validate({**body, "stream": True})
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        raise APIError(400, f"Invalid request: {first['msg']}.", param=param) from None


def error_event(status: int, body: dict[str, Any]) -> str:
    """An error before a response started, as OpenAI's WebSocket mode sends it: the
    OpenAI-shaped `body`'s error, with the status an HTTP request would have had."""
    return json.dumps({"type": "error", "status": status, **body}, ensure_ascii=False)


def api_error_event(e: APIError) -> str:
    return error_event(e.status, error_body(e.message, e.type, e.param, e.code))


def stream_messages(chunk: str) -> list[str]:
    """The socket's messages for a piece of the SSE stream: each event's data, as it is;
    keep-alive comments are left out (the socket has its own pings)."""
    return [
        line[len("data: ") :]
        for line in chunk.split("\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
