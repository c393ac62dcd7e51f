"""ASGI middleware: request counting and the request body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ..serving.api_errors import error_body
from ..serving.metrics import Metrics
from .error_handlers import shaped


class RequestCounter:
    """ASGI middleware counting responses by route template and status."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def recording_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status)).inc()


class BodyLimit:
    """Refuses request bodies over `max_bytes` (413) or slower than `timeout` seconds (408),
    before anything parses them."""

    def __init__(self, app: Any, max_bytes: int, timeout: float = 60.0) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, 413, scope["path"])
            return
        received, refused, body_done = 0, 0, False
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def counting_receive() -> dict:
            nonlocal received, refused, body_done
            if body_done:  # after the body only a disconnect comes: no deadline for it
                return await receive()
            try:
                left = deadline - asyncio.get_running_loop().time()
                message = await asyncio.wait_for(receive(), max(left, 0))
            except TimeoutError:
                refused = 408  # a body sent a trickle at a time would hold the request forever
                return {"type": "http.disconnect"}  # the app stops reading here
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    refused = 413
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)
        if refused:
            await self._refuse(send, refused, scope["path"])

    async def _refuse(self, send: Any, status: int, path: str) -> None:
        if status == 413:
            message, code = (
                f"The request body is larger than this server accepts ({self.max_bytes} bytes).",
                "request_too_large",
            )
        else:
            message, code = (
                f"The request body did not arrive within {self.timeout:g}s.",
                "request_timeout",
            )
        body = error_body(message, "invalid_request_error", code=code)
        body = json.dumps(shaped(path, status, body)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
