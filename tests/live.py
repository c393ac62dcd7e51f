"""A real server (uvicorn on a free loopback port) around an engine, for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from mlx_cache_server.engine import Engine
from mlx_cache_server.models.engine_build import build_engine
from mlx_cache_server.models.pool import ModelPool
from mlx_cache_server.server import create_app
from mlx_cache_server.server.connections import uvicorn_config
from mlx_cache_server.serving.metrics import Metrics
from mlx_cache_server.settings import Settings, load_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(length: int, avoid: Collection[int] = ()) -> int:
    """The first of `length` consecutive loopback ports that are free now and not in `avoid`.

    `mlx.launch`'s ring backend binds `--starting-port` plus one per rank; a port from
    `free_port` says nothing about its neighbour, which may be taken or be the HTTP port."""
    for _ in range(200):
        start = free_port()
        ports = range(start, start + length)
        if start + length > 65536 or any(port in avoid for port in ports):
            continue
        with ExitStack() as held:
            try:
                for port in ports:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return start
    raise RuntimeError(f"no {length} consecutive free loopback ports found")


class LiveServer:
    """`models`: one engine (started and stopped here), or a pool (its models loaded on use,
    unloaded at stop)."""

    def __init__(
        self,
        models: Engine | ModelPool,
        settings: Settings | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = models if isinstance(models, Engine) else None
        self.pool = models if isinstance(models, ModelPool) else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = settings or Settings()
        self.app = create_app(models, settings=settings, metrics=metrics)
        config = uvicorn_config(
            self.app, settings, host="127.0.0.1", port=self.port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> LiveServer:
        if self.engine is not None:
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
        if self.pool is not None:
            self.pool.close()
            return
        self.engine.stop()
        if self.engine.cache is not None and self.engine.cache.disk is not None:
            self.engine.cache.disk.close(10)


def settings_of(**settings: Any) -> Settings:
    """`Settings` as the command reads them: the environment's MLX_CACHE_SERVER_* under
    these (the portable lane turns the CPU fast path off so)."""
    return load_settings(None, settings)


@contextmanager
def serving(model_dir: str, **settings) -> Iterator[LiveServer]:
    """A server in this process, set up as `mlx-cache-server serve` would be with these
    settings: the environment's MLX_CACHE_SERVER_* under them (the portable lane turns
    the CPU fast path off so)."""
    config = settings_of(**settings)
    server = LiveServer(build_engine(config, model_dir), config).start()
    try:
        yield server
    finally:
        server.stop()


def start_server(model_dir, *flags: str, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m mlx_cache_server serve` on the model, as a user starts it; returns once it
    answers.

    Its output comes on `proc.stdout`, or with `log` goes to that file: a server that
    logs much (one line per request) must not write to a pipe nobody reads, which fills
    and stops it."""
    port = free_port()
    out = log.open("w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_cache_server", "serve", "--model", str(model_dir),
         "--port", str(port), "--served-model-name", "tiny", *flags],
        stdout=out, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
    )  # fmt: skip
    if log is not None:
        out.close()  # the child holds its own copy
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text() if log is not None else proc.stdout.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
        assert time.monotonic() < deadline


@contextmanager
def server_process(model_dir, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """`start_server` for a `with` block, its output in `log`: stopped at the block's end."""
    proc, url = start_server(model_dir, log=log)
    try:
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(30)
