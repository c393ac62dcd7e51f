"""The engine thread: its start and stop, and the loop that runs one step after another.

`StepLoop` is the engine's thread and what it alone steps through: the inbox requests
wait in, the step source, and the batch, which it makes with the factory it is handed.
Each step takes its inputs from the step source (this process, or rank 0 of a sharded
server), admits new requests into the batch, runs one batched step, and gives memory
back once the engine has been idle a while. A step that fails fails what was running
and the engine starts afresh, except on a sharded server, whose ranks could no longer
agree: there the engine ends.

Invariants: a request handed to `accept` either reaches the inbox before the thread's
last take, or is failed at once (`_closing` orders the two); once the thread has ended,
every request it took has ended.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from ..runtime import memory
from .events import EngineStats, Failed
from .request import Request, with_followers
from .steps import LocalSteps, StepInputs, StepSource

if TYPE_CHECKING:
    from .batch import Batch
    from .quantized_kv import QuantizedKVRunner
    from .wiring import Fail, Requeue

log = logging.getLogger("mlx_cache_server.engine")

# Makes the batch the steps run in, handed the loop's `fail` and `requeue`.
NewBatch = Callable[["Fail", "Requeue"], "Batch | QuantizedKVRunner"]

SHUTTING_DOWN = "The server is shutting down; retry on another server or later."
SHARD_LOST = (
    "A process of this sharded server failed, so the server is stopping; retry once the "
    "launcher has restarted it."
)


class StepLoop:
    """`accept`, `stop`, `abandon`, the `ask_` methods and the counters' reads run on any
    thread; `requeue` and the steps on the engine thread alone."""

    def __init__(
        self, stats: EngineStats, *, clock: Callable[[], float], release_after: float
    ) -> None:
        self.stats = stats
        self.release_after = release_after  # idle seconds before pooled memory goes back
        self._inbox: queue.Queue[Request | None] = queue.Queue()  # None: wake up, see `stop`
        self.local_steps = LocalSteps(self._inbox, clock)
        # Where the steps' inputs come from: this process, or rank 0 of a sharded server.
        self.steps: StepSource = self.local_steps
        self.sharded = False  # a rank of a sharded server: a failed step ends the engine
        self.failure: str | None = None  # why a sharded engine ended, for /health
        self.stepping_since: float | None = None  # monotonic start of the step under way
        self.on_failure: Callable[[str], None] | None = None  # told once the engine ended so
        self._requeued: list[Request] = []  # engine thread: admitted again at the next step
        self._release_asked = threading.Event()
        self.thread: threading.Thread | None = None
        self._closing = threading.Lock()  # orders a submit against the thread's last take
        self._closed = False
        self.running = 0  # requests admitted and not finished (read by /health)
        self.queued = 0  # requests taken by the thread, waiting for their prefill to start

    @property
    def clock(self) -> Callable[[], float]:
        """The clock a step's time is read from (on rank 0, when sharded)."""
        return self.local_steps.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.local_steps.clock = clock

    @property
    def closed(self) -> bool:
        """The thread has taken its last request: what is submitted now fails at once."""
        return self._closed

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted: in the inbox or the batch's queue."""
        return self._inbox.qsize() + self.queued

    def accept(self, request: Request) -> None:
        """Hand a request to the thread, from any thread; failed at once once it is closed."""
        with self._closing:
            if self._closed:  # the thread has taken its last request
                self.fail([request], SHARD_LOST if self.failure else SHUTTING_DOWN, "shutdown")
            else:
                self._inbox.put(request)

    def ask_flush(self) -> None:
        """Sharded: empty every rank's prompt cache at the next step, which this asks for."""
        self.local_steps.flush_asked.set()
        self._inbox.put(None)  # an idle engine steps now

    def ask_release(self) -> None:
        """Hand pooled memory back to the system as soon as the engine is idle."""
        self._release_asked.set()

    # The thread is handed the engine's callbacks when it starts, and drops them when it
    # ends (`Thread` lets go of its arguments): kept here, they would tie the engine and
    # this loop in a cycle, and an unloaded model would wait for a garbage collection
    # instead of going the moment its last holder lets go.

    def start(self, new_batch: NewBatch, clear_cache: Callable[[], int]) -> None:
        """Start the thread. `new_batch(fail, requeue)`: a batch, handed this loop's `fail`
        and `requeue`; `clear_cache`: empties the prompt cache (a flush, at its step)."""
        self.local_steps.stopping.clear()
        self._closed = False
        self.thread = threading.Thread(
            target=self._loop, args=(new_batch, clear_cache), name="mlx-engine", daemon=True
        )
        self.thread.start()

    def run(self, new_batch: NewBatch, clear_cache: Callable[[], int]) -> None:
        """Run the steps on this thread until the engine stops (a sharded server's other
        ranks, which do nothing else); the arguments as `start`'s."""
        self._closed = False
        self._loop(new_batch, clear_cache)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running or queued fail ("shutting down")."""
        self.local_steps.stopping.set()
        self._inbox.put(None)  # an idle thread waiting for requests sees the stop at once
        if self.thread is not None:  # an abandoned one is stuck: no waiting for it
            self.thread.join(0 if self.failure else timeout)
            if self.sharded and self.thread.is_alive():  # stuck on a process that is gone
                self.abandon("the engine did not stop: a process of the sharded model is gone")

    @property
    def alive(self) -> bool:
        return self.failure is None and self.thread is not None and self.thread.is_alive()

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
        """Engine thread: admit `request` again at the next step."""
        self._requeued.append(request)

    def fail(self, requests: list[Request], message: str, reason: str = "error") -> None:
        """End these requests and those waiting on them with `message`, each once."""
        for request in dict.fromkeys(with_followers(requests)):
            if not request.ended:
                request.end(Failed(message, reason))
                self.stats.failed += 1

    def _loop(self, new_batch: NewBatch, clear_cache: Callable[[], int]) -> None:
        batch: Batch | QuantizedKVRunner | None = None
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
                if inputs.flush:
                    clear_cache()
                if inputs.release:
                    memory.release_memory()
                if batch is not None and inputs.measured is not None:
                    m = inputs.measured
                    batch.costs.saw_step(m.seconds, m.prompt_tokens, m.decoded, m.depth)
                new, self._requeued = [*self._requeued, *inputs.new], []
                if new:
                    batch = batch or new_batch(self.fail, self.requeue)
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
