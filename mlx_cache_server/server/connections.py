"""HTTP connections a hostile or broken client cannot use to hurt others.

uvicorn's own protocols leave holes: httptools accepts headers of any size (a
probe sent hundreds of MiB on one connection), neither closes a connection that
sends its headers a byte at a time, and a response whose client never reads
waits for it forever, holding its generation, its slot and its connection. The
server therefore always runs `GuardedH11` (h11, whose buffer limit bounds a
request's headers, whatever else is installed): a deadline for each request's
headers, a deadline for a stalled write, and a cap on connections; and
`HeaderLimit` for the headers' count.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..serving.api_errors import error_body
from ..settings import Settings
from .error_handlers import shaped

log = logging.getLogger("mlx_cache_server.connections")

START_LINE = 512  # bytes of a request kept to read its path from, should it be refused

MAX_HEADER_BYTES = 32 * 1024
MAX_HEADERS = 100
END_MARGIN = 5.0  # seconds past the shutdown grace for failed streams to send their end


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with deadlines for headers and stalled writes, and a cap.

    - Headers: from the connection's start, or the previous response's end,
      until a request's headers are complete; past it the connection is closed
      (with a 408 if the client had begun a request). Over `max_header_bytes`: 431.
    - Writes: once the client's buffers are full, it has `write_timeout` to read
      some; then the connection is dropped (aborted: a close would wait for the
      buffers to drain, which they never do), and the response's generation ends.
    - Connections past `max_connections` are closed as soon as they are made.
    """

    header_timeout: float = 10.0
    write_timeout: float = 60.0
    max_header_bytes: int = MAX_HEADER_BYTES
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._write_stall: asyncio.TimerHandle | None = None
        self._refused = False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("over %d connections: closing a new one", self.max_connections)
            transport.abort()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request: read and dropped (see _refuse)
        if self._deadline is not None:
            if self._header_bytes < START_LINE:  # which API a refusal answers in
                self._start_line += data[: START_LINE - self._header_bytes]
            self._header_bytes += len(data)
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._cycle_before:
            self._stop_deadline()  # the headers are in: the request is the app's now

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The headers are in and the connection is the WebSocket's from here: no request
        # follows for the deadline to wait for (left armed, it would cut the socket).
        self._stop_deadline()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        if self.transport.is_closing():
            super().on_response_complete()
            return
        # Armed first: finishing a response can start a pipelined request at once.
        self._await_headers()
        super().on_response_complete()
        if self.cycle is not self._cycle_before:
            self._stop_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.write_timeout, self._not_reading)

    def resume_writing(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        super().connection_lost(exc)

    def _not_reading(self) -> None:
        self._write_stall = None
        log.warning("dropping a connection whose client read nothing for %gs", self.write_timeout)
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        if self._deadline is not None and self._header_bytes > self.max_header_bytes:
            self._stop_deadline()
            self._refuse(
                431,
                f"The request's headers are larger than this server accepts "
                f"({self.max_header_bytes} bytes).",
                "request_headers_too_large",
            )
            return
        super().send_400_response(msg)

    def _await_headers(self) -> None:
        self._stop_deadline()
        self._cycle_before, self._header_bytes, self._start_line = self.cycle, 0, b""
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._header_bytes and self.conn.their_state is h11.IDLE:
            message = f"The request's headers did not arrive within {self.header_timeout:g}s."
            self._refuse(408, message, "request_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` and close, after reading what the client still sends for a moment.

        Closing a socket with unread input resets the connection, and the client
        may lose the answer; so the write side closes first and the rest of the
        request is read and dropped until the client closes, for at most a second.
        """
        words = self._start_line.split(b"\r\n", 1)[0].split(b" ")
        path = words[1].decode("latin-1").partition("?")[0] if len(words) > 2 else ""
        body = error_body(message, "invalid_request_error", code=code)
        body = json.dumps(shaped(path, status, body)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot answer in its state: just close
            self.transport.close()
            return
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)


class HeaderLimit:
    """Refuses requests with more than `max_headers` headers (431)."""

    def __init__(self, app: Any, max_headers: int = MAX_HEADERS) -> None:
        self.app, self.max_headers = app, max_headers

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or len(scope["headers"]) <= self.max_headers:
            await self.app(scope, receive, send)
            return
        body = error_body(
            f"The request has {len(scope['headers'])} headers; this server accepts at most "
            f"{self.max_headers}.",
            "invalid_request_error",
            code="too_many_headers",
        )
        body = json.dumps(shaped(scope["path"], 431, body)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 431, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for serving `app`, with the guards above."""
    limits = {
        "header_timeout": settings.header_timeout,
        "write_timeout": settings.write_timeout,
        "max_connections": settings.max_connections,
    }
    protocol = type("GuardedH11", (GuardedH11,), limits)
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": settings.shutdown_grace + END_MARGIN,
        "http": protocol,
        # h11 refuses a request whose headers pass this many bytes; GuardedH11 answers 431.
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        # The Responses API's WebSocket (routes/responses.py) through the `websockets`
        # library, named rather than left to "auto", which takes whichever is installed; its
        # messages are request bodies, held to the same limit.
        "ws": "websockets-sansio",
        "ws_max_size": settings.max_body_bytes,
    }
    return uvicorn.Config(app, **{**options, **overrides})
