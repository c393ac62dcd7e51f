"""The uvicorn server the CLI runs: a graceful stop that ends every stream properly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from signal import SIGINT, SIGTERM

import uvicorn

log = logging.getLogger("mlx_cache_server")


class GracefulServer(uvicorn.Server):
    """uvicorn's shutdown on SIGINT/SIGTERM, ending every stream properly, and exit 0.

    Requests still running when the grace period ends are failed by stopping
    the engines, so their streams end with an error event and `[DONE]` instead
    of being cut; uvicorn's own cancellation (`connections.END_MARGIN` later)
    is only the last resort. uvicorn re-raises the signal once it has shut
    down, which would kill the process before the engine is stopped and make
    a clean stop look like a crash.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        stop_engines: Callable[[], None],
        grace: float,
        draining: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(config)
        self.stop_engines, self.grace, self.draining = stop_engines, grace, draining

    async def _wait_tasks_to_complete(self) -> None:
        self.draining()  # streams that would run on forever end now
        try:
            await asyncio.wait_for(super()._wait_tasks_to_complete(), self.grace)
        except TimeoutError:
            log.warning("grace period over: ending the requests still running")
            await asyncio.to_thread(self.stop_engines)
            await super()._wait_tasks_to_complete()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self.handle_exit) for s in (SIGINT, SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
