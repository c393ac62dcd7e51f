"""A real server (uvicorn on a free loopback port) around an engine, for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from app.engine import Engine
from app.server import build_engine, create_app
from app.server.connections import uvicorn_config
from app.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, engine: Engine, settings: Settings | None = None) -> None:
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = settings or Settings()
        self.app = create_app(engine, settings=settings)
        config = uvicorn_config(
            self.app, settings, host="127.0.0.1", port=self.port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> LiveServer:
        self.engine.start()
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self.engine.stop()


@contextmanager
def serving(model_dir: str, **settings) -> Iterator[LiveServer]:
    config = Settings(**settings)
    server = LiveServer(build_engine(config, model_dir), config).start()
    try:
        yield server
    finally:
        server.stop()
