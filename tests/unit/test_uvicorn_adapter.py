"""What the server extends of uvicorn (not public API) is still there, in the installed uvicorn.

`server.connections.GuardedH11` overrides methods of uvicorn's h11 protocol and
`server.graceful.GracefulServer` one of its server; a uvicorn release that renames them
would silently drop the guards, so these tests fail instead.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def test_the_installed_uvicorn_is_the_release_line_the_guards_were_checked_for():
    major, minor, *_ = version("uvicorn").split(".")
    assert (int(major), int(minor)) == (0, 54), (
        "re-check mlx_cache_server/server/connections.py and graceful.py"
    )


def test_the_methods_the_guards_override_exist_with_the_same_signatures():
    for name, params in {
        "connection_made": ["self", "transport"],
        "data_received": ["self", "data"],
        "connection_lost": ["self", "exc"],
        "on_response_complete": ["self"],
        "pause_writing": ["self"],
        "resume_writing": ["self"],
        "send_400_response": ["self", "msg"],
        "handle_websocket_upgrade": ["self", "event"],
    }.items():
        assert list(inspect.signature(getattr(H11Protocol, name)).parameters) == params, name
    assert inspect.iscoroutinefunction(uvicorn.Server._wait_tasks_to_complete)
    assert "capture_signals" in vars(uvicorn.Server)
