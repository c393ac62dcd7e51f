"""Exception handlers: every error leaves the server in OpenAI's shape, never a bare 422 or 500."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.errors import APIError, error_body

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
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            msg = "We could not parse the JSON body of your request. Send valid JSON."
            return JSONResponse(error_body(msg, "invalid_request_error"), 400)
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "missing":
            msg = f"Missing required parameter: '{param}'." if param else "Missing request body."
        else:
            msg = f"Invalid value for '{param}': {first.get('msg')}." if param else first["msg"]
        return JSONResponse(error_body(msg, "invalid_request_error", param, first.get("type")), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), kind), e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        # The detail is for the operator; the client gets what it can act on.
        request_id = f"req-{uuid.uuid4().hex[:16]}"
        log.exception("unhandled error (request id %s)", request_id)
        message = (
            f"The server had an error while processing your request (request id {request_id}). "
            "Retry; if it persists, report the request id."
        )
        return JSONResponse(
            error_body(message, "server_error"), 500, headers={"x-request-id": request_id}
        )
