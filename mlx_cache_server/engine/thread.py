"""The engine thread: its start and stop, and the loop that runs one step after another.

`EngineThread` is a part of `Engine` (the thread runs on the engine's state). Each
step takes its inputs from the step source (this process, or rank 0 of a sharded
server), admits new requests into the batch, runs one batched step, and gives
memory back once the engine has been idle a while. A step that fails fails what was
running and the engine starts afresh, except on a sharded server, whose ranks could
no longer agree: there the engine ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from ..runtime import memory
from .batch import Batch
from .events import EngineStats, Failed
from .request import Request, with_followers
from .solo import Solo
from .steps import LocalSteps, StepInputs, StepSource

if TYPE_CHECKING:
    import queue

    from mlx_cache_server.prompt_cache import PromptCache

log = logging.getLogger("mlx_cache_server.engine")

SHUTTING_DOWN = "The server is shutting down; retry on another server or later."
SHARD_LOST = (
    "A process of this sharded server failed, so the server is stopping; retry once the "
    "launcher has restarted it."
)


class EngineThread:
    cache: PromptCache | None
    stats: EngineStats
    local_steps: LocalSteps
    steps: StepSource
    sharded: bool
    failure: str | None
    stepping_since: float | None
    on_failure: Callable[[str], None] | None
    release_after: float
    kv_bits: int | None
    kv_group_size: int
    running: int
    queued: int
    clock: Callable[[], float]
    _inbox: queue.Queue[Request | None]
    _requeued: list[Request]
    _release_asked: threading.Event
    _thread: threading.Thread | None
    _closing: threading.Lock
    _closed: bool
    _clear_cache: Callable[[], int]

    def start(self) -> None:
        self.local_steps.stopping.clear()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="mlx-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the steps on this thread until the engine stops (a sharded server's other
        ranks, which do nothing else)."""
        self._closed = False
        self._loop()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running or queued fail ("shutting down")."""
        self.local_steps.stopping.set()
        self._inbox.put(None)  # an idle thread waiting for requests sees the stop at once
        if self._thread is not None:  # an abandoned one is stuck: no waiting for it
            self._thread.join(0 if self.failure else timeout)
            if self.sharded and self._thread.is_alive():  # stuck on a process that is gone
                self.abandon("the engine did not stop: a process of the sharded model is gone")

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    def abandon(self, why: str) -> None:
        """End every request now, from any thread: this sharded engine's thread is stuck
        in a step waiting on a process that is gone (MLX's ring backend can wait forever
        when a peer dies in the middle of a forward pass). Nothing is served after."""
        self.failure = self.failure or why
        with self._closing:
            self._closed = True
        taken = [*self.local_steps.live(), *self.local_steps.leftovers()]
        self.fail([*taken, *self._requeued], SHARD_LOST, "shutdown")

    def requeue(self, request: Request) -> None:
        self._requeued.append(request)

    def fail(self, requests: list[Request], message: str, reason: str = "error") -> None:
        """End these requests and those waiting on them with `message`, each once."""
        for request in dict.fromkeys(with_followers(requests)):
            if not request.ended:
                request.end(Failed(message, reason))
                self.stats.failed += 1

    def _loop(self) -> None:
        batch: Batch | Solo | None = None
        idle_since: float | None = None  # set when the last request ended; None once released
        inputs: StepInputs | None = None
        while True:
            new: list[Request] = []
            try:
                busy = bool(self._requeued) or (batch is not None and batch.busy)
                # From here: rank 0's handover waits on the last step's forward pass.
                self.stepping_since = time.monotonic()
                inputs = self.steps.next(busy)
                if inputs.stop:
                    break
                for request in inputs.cancelled:
                    request.cancelled = True
                if inputs.flush and self.cache is not None:
                    self._clear_cache()
                if inputs.release:
                    memory.release_memory()
                if batch is not None and inputs.measured is not None:
                    m = inputs.measured
                    batch.costs.saw_step(m.seconds, m.prompt_tokens, m.decoded, m.depth)
                new, self._requeued = [*self._requeued, *inputs.new], []
                if new:
                    batch = batch or self._new_batch()
                if batch is not None:
                    batch.now = inputs.now
                if new:
                    batch.intake(new)
                if batch is not None and batch.busy:
                    idle_since = None
                    batch.drop_cancelled()
                    if batch.busy:
                        batch.step()
                        self.steps.measured(batch.cost)
                    if not batch.busy:  # the last request just left
                        memory.trim_heap()
                        idle_since = self.clock()
                elif self._release_asked.is_set() or (
                    idle_since is not None and self.clock() - idle_since > self.release_after
                ):
                    # Only after a pause: back-to-back turns would each pay to fault
                    # freshly allocated buffers back in.
                    self._release_asked.clear()
                    if self.sharded:  # every rank at the next step, which this asks for
                        self.local_steps.release_asked.set()
                    else:
                        memory.release_memory()
                    idle_since = None
            except Exception as e:  # keep serving: fail what was running, start afresh
                # What a request supplies runs guarded (`request.guarded`), so what lands
                # here is the batch's own failure. Requests taken but not yet admitted fail
                # too: nobody is left waiting for an event that will never come.
                if self.sharded:  # the ranks may no longer agree: nothing can run on
                    log.exception("a step of the sharded engine failed; it stops")
                    self.failure = f"a step of the sharded model failed: {e}"
                    break  # its requests are failed below, with the rest
                running = batch.everyone() if batch is not None else []
                log.exception("generation failed")
                self.fail([*new, *running], "Generation failed on the server. Retry.")
                if batch is not None:
                    with contextlib.suppress(Exception):  # what failed may fail again here
                        batch.close()
                batch = None
                idle_since = self.clock()  # what the failed batch held can go back too
            finally:
                self.stepping_since = None
                self.running = len(batch.active) if batch is not None else 0
                self.queued = len(batch.queue) if batch is not None else 0
        with self._closing:
            self._closed = True
            running = batch.everyone() if batch is not None else []
            taken = inputs.new if inputs is not None and inputs.stop else []
            message = SHARD_LOST if self.failure else SHUTTING_DOWN
            # `live`: also those taken in a step whose handover to the other ranks failed.
            every = [*running, *taken, *self._requeued, *self.local_steps.live()]
            self.fail([*every, *self.local_steps.leftovers()], message, "shutdown")
        if self.failure is not None:
            # Not a wait on MLX's streams: one may hold a collective that never returns.
            if self.on_failure is not None:
                self.on_failure(self.failure)
            return
        if batch is not None:
            batch.close()
        mx.synchronize()  # finish the cache's asynchronous copies before the thread ends

    def _new_batch(self) -> Batch | Solo:
        if self.kv_bits is None:
            return Batch(self)
        return Solo(self, self.kv_group_size, self.kv_bits)
