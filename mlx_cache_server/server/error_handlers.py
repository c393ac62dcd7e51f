"""Exception handlers: every error leaves the server in OpenAI's shape, never a bare 422 or 500."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.api_errors import APIError, error_body

log = logging.getLogger("mlx_cache_server.errors")


def _param(loc: tuple) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not out:
            out = str(p)
        elif p in ("str", "list[TextPart]", "list[str]", "list[int]", "list[list[int]]"):
            continue  # pydantic names the union member it tried; not useful to users
        else:
            out += f".{p}"
    return out or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        body = error_body(e.message, e.type, e.param, e.code)
        return _response(request, e.status, body, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            msg = "We could not parse the JSON body of your request. Send valid JSON."
            return _response(request, 400, error_body(msg, "invalid_request_error"))
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "missing":
            msg = f"Missing required parameter: '{param}'." if param else "Missing request body."
        else:
            msg = f"Invalid value for '{param}': {first.get('msg')}." if param else first["msg"]
        body = error_body(msg, "invalid_request_error", param, first.get("type"))
        return _response(request, 400, body)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        body = error_body(str(e.detail), kind)
        return _response(request, e.status_code, body, getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        body, request_id = logged_failure()
        return _response(request, 500, body, {"x-request-id": request_id})


def logged_failure() -> tuple[dict, str]:
    """The 500 body for the error being handled, logged under a new request id; the id.

    The detail is for the operator; the client gets what it can act on."""
    request_id = f"req-{uuid.uuid4().hex[:16]}"
    log.exception("unhandled error (request id %s)", request_id)
    message = (
        f"The server had an error while processing your request (request id {request_id}). "
        "Retry; if it persists, report the request id."
    )
    return error_body(message, "server_error"), request_id


# Anthropic's error types by status, for its Messages API's routes.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def shaped(path: str, status: int, body: dict) -> dict:
    """An OpenAI-shaped error body in the shape of the API `path` belongs to: OpenAI's, or
    Anthropic's for its Messages API."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        # Anthropic: its other 4xx are invalid requests; api_error is its own failure.
        kind = _ANTHROPIC_TYPES.get(
            status, "invalid_request_error" if status < 500 else "api_error"
        )
        # Anthropic's shape has no `param`: its own messages start with the field instead.
        error = body["error"]
        message = (
            f"{error['param']}: {error['message']}" if error.get("param") else error["message"]
        )
        return {"type": "error", "error": {"type": kind, "message": message}}
    return body


def _response(
    request: Request, status: int, body: dict, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(shaped(request.url.path, status, body), status, headers=headers)
