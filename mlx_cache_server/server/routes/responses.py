"""POST /v1/responses (OpenAI's Responses API), and the same over a WebSocket
(`GET /v1/responses` upgraded; `serving.responses_socket`)."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketState

from ...serving.api_errors import APIError, error_body
from ...serving.response_store import ResponseStore
from ...serving.responses import ResponsesRequest
from ...serving.responses_socket import (
    api_error_event,
    connection_memory,
    error_event,
    read_create,
    stream_messages,
)
from ..auth import Tenant, authorize
from ..error_handlers import logged_failure
from ..state import ServerState, State, server_state
from ..while_loading import respond, responses

router = APIRouter(tags=["responses"])


@router.post("/v1/responses", summary="Create a response (OpenAI's Responses API)")
async def create_response(req: ResponsesRequest, request: Request, state: State, tenant: Tenant):
    return await respond(
        state,
        req.model,
        lambda served: served.responses.create(req, request, tenant),
        responses(req) if req.stream else None,
    )


@router.websocket("/v1/responses")
async def responses_socket(websocket: WebSocket) -> None:
    """The key is checked on the upgrade: a wrong one is refused with the 401 a POST gets."""
    try:
        tenant = authorize(websocket)
    except APIError as e:
        body = error_body(e.message, e.type, e.param, e.code)
        await websocket.send_denial_response(JSONResponse(body, e.status, e.headers))
        return
    await websocket.accept()
    socket = _ResponsesSocket(websocket, server_state(websocket), tenant, connection_memory())
    with contextlib.suppress(WebSocketDisconnect):
        await socket.serve()


class _ResponsesSocket:
    """One connection: its requests answered one at a time, in the order they came."""

    def __init__(
        self, websocket: WebSocket, state: ServerState, tenant: str | None, kept: ResponseStore
    ) -> None:
        self.websocket, self.state, self.tenant, self.kept = websocket, state, tenant, kept

    async def serve(self) -> None:
        """Until the client closes (WebSocketDisconnect) or the server stops."""
        while self.websocket.application_state is WebSocketState.CONNECTED:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            await self._answer(message.get("text"))

    async def _answer(self, text: str | None) -> None:
        try:
            req = read_create(text)
            response = await respond(
                self.state,
                req.model,
                lambda served: served.responses.create(req, None, self.tenant, self.kept),
                responses(req),
            )
        except APIError as e:
            await self.websocket.send_text(api_error_event(e))
            return
        except Exception:
            await self.websocket.send_text(error_event(500, logged_failure()[0]))
            return
        # Closed here, not left to the garbage collector: a client gone mid-response ends
        # its generation at once.
        async with contextlib.aclosing(response.body_iterator) as body:
            async for chunk in body:
                for data in stream_messages(chunk):
                    await self.websocket.send_text(data)
