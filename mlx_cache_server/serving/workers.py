"""The threads a request's preparation runs on: templating apart from grammars, each bounded.

Rendering a chat, tokenizing it and compiling a client's grammar run off the
event loop, which would otherwise stall every stream. They do not share
asyncio's default pool: a pool of its own for each kind of work means requests
that bring costly grammars wait for each other, never for a plain chat's
template, and neither takes the threads other parts of the server use.

Invariants:
- At most `workers` threads of a pool run at once; what is submitted past that
  waits in the pool's queue.
- Each piece of work has a time budget to wait for a thread and another to run.
  Work still queued when the first runs out is dropped and the request gets a 503
  (the server is busy: retry); work that runs past the second gets a 400 naming
  what was too costly. A thread cannot be stopped: work past its budget runs to
  its end, so the bounds checked before it (the prompt's size, a schema's
  limits) are what keep it short.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .api_errors import APIError

T = TypeVar("T")


class Pool:
    """A bounded thread pool for one kind of a request's preparation, with a time budget."""

    def __init__(self, name: str, workers: int, budget: float, what: str) -> None:
        self.name, self.workers, self.budget, self.what = name, workers, budget, what
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # Made on first use: a process that never serves a request starts no threads.
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.workers, thread_name_prefix=self.name
                )
            return self._executor

    async def run(self, fn: Callable[..., T], *args: Any, param: str | None = None) -> T:
        """`fn(*args)` on one of the pool's threads; what it returns or raises, or an
        APIError: a 503 if it waited a whole budget for a thread (the server is busy),
        a 400 if it ran a whole budget (the request asks too much)."""
        loop = asyncio.get_running_loop()
        began: list[float] = []

        def work() -> T:
            began.append(loop.time())
            return fn(*args)

        future = self._pool().submit(work)
        done = asyncio.wrap_future(future)
        try:
            # asyncio.wait, not wait_for: a cancellation that comes as the work ends is
            # never swallowed (the request's generation would run on for a gone client).
            await asyncio.wait({done}, timeout=self.budget)
            if not done.done() and began:
                ran = loop.time() - began[0]
                await asyncio.wait({done}, timeout=max(self.budget - ran, 0))
        except asyncio.CancelledError:
            future.cancel()  # dropped if still queued; a running one goes on to its end
            raise
        if done.done():
            return done.result()
        future.cancel()
        if not began:
            raise APIError(
                503,
                f"The server is busy {self.what} for other requests. Retry shortly.",
                type="service_unavailable",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        raise APIError(
            400,
            f"This request took over {self.budget:g} s {self.what}; make it simpler.",
            param=param,
            code="request_too_complex",
        )


# Templates and tokenizers: every request's prompt passes here, bounded by its size.
TEMPLATING = Pool("templating", workers=4, budget=60.0, what="rendering prompts")
# A client's JSON schemas and grammars, compiled: bounded by `schema_checks`' limits.
GRAMMARS = Pool("grammars", workers=2, budget=30.0, what="compiling grammars")
