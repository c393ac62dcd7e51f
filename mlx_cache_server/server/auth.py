"""API keys: `Authorization: Bearer <key>`, compared in constant time.

Each key is a tenant. Its prompts are cached in a namespace of its own, so one
tenant's prompts can never be reused by, nor timed by, another.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from starlette.requests import HTTPConnection

from ..serving.api_errors import APIError
from .state import server_state


def tenant_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _bearer(request: HTTPConnection) -> str | None:
    """The key a client sent: `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


def _matches(token: str | None, keys: list[str]) -> bool:
    # Every key is compared, matched or not, so timing tells nothing about which.
    given = (token or "").encode()
    return any([hmac.compare_digest(given, k.encode()) for k in keys]) and token is not None


def authorize(request: HTTPConnection) -> str | None:
    """The caller's tenant (None when the server has no keys); a WebSocket's from its
    upgrade request's headers."""
    keys = server_state(request).settings.api_keys
    if not keys:
        return None
    token = _bearer(request)
    if not _matches(token, keys):
        raise APIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return tenant_of(token)


def authorize_admin(request: Request) -> None:
    """Admin routes see and flush every tenant's cache: never open to a tenant's key.

    Without API keys the server is open and so are they; with API keys they need
    the admin key, and are off when none is set.
    """
    settings = server_state(request).settings
    admin = settings.admin_key
    if admin is None:
        if settings.api_keys:
            raise APIError(
                403,
                "Admin routes are off: this server has API keys and no admin key. "
                "Start it with --admin-key KEY to use them.",
                type="permission_error",
                code="admin_disabled",
            )
        return
    if not _matches(_bearer(request), [admin]):
        raise APIError(
            401,
            "This route needs the admin key. Send it as 'Authorization: Bearer <admin key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


Tenant = Annotated[str | None, Depends(authorize)]
Admin = Depends(authorize_admin)
