"""The web pages: chat at `/`, the cache at `/ui/cache`, their scripts and style.

Static files shipped in the package (`ui/static`), no build step. The pages call the
API from the browser with the key the user typed (the API's own auth); the files
themselves are open, as they hold nothing but code. A strict Content-Security-Policy:
scripts and styles from this server only, requests to this server only, no frames.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from ...serving.api_errors import APIError

STATIC = Path(__file__).resolve().parents[2] / "ui" / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}  # fmt: skip
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> Response:
    path = STATIC / name
    try:
        found = path.parent == STATIC and path.suffix in TYPES and path.is_file()
    except (OSError, ValueError):  # a name the system cannot open (too long): not ours
        found = False
    if not found:
        raise APIError(404, f"No page or file '/ui/{name[:100]}'.", code="not_found")
    return FileResponse(path, media_type=TYPES[path.suffix], headers=HEADERS)


@router.get("/")
async def chat_page() -> Response:
    return _file("index.html")


@router.get("/ui/cache")
async def cache_page() -> Response:
    return _file("cache.html")


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    return _file(name)
