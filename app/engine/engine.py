"""The generation engine: one thread owns MLX and serves every request.

Requests arrive on a queue; the engine thread takes each one's starting state
from the prompt cache, runs all of them together in one `Batch` (mlx-lm's
continuous batching), and streams events back to the asyncio handlers through
`loop.call_soon_threadsafe`, so the event loop never waits on the model. When a
request ends (finished, stopped or cancelled) the KV of its prompt plus what it
generated goes back into the cache for the next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import mlx.core as mx

from prompt_cache import PromptCache, fresh_cache
from prompt_cache.layers import mode_of

from ..runtime import memory
from .batch import Batch
from .constraint import GrammarTokenizer
from .events import EngineStats, Event, Failed, Finished, SamplingParams
from .request import Request, with_followers
from .solo import Solo
from .steps import LocalSteps, StepInputs, StepSource

log = logging.getLogger("mlx_cache_server.engine")

SHUTTING_DOWN = "The server is shutting down; retry on another server or later."
SHARD_LOST = (
    "A process of this sharded server failed, so the server is stopping; retry once the "
    "launcher has restarted it."
)


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        cache: PromptCache | None,
        context_length: int,
        completion_batch_size: int = 16,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 512,
        decode_gap: float = 0.8,
        min_prefill_chunk: int = 32,
        min_shared_prefix: int = 32,
        max_prefill_wait: float = 10.0,
        release_after: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        generation_config: dict[str, Any] | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.cache = cache
        # How the cache stores this model: "prefix" (attention only), "checkpointed" (a
        # hybrid: its other layers' state stored where `checkpoints_of` says) or "snapshot".
        self.cache_mode = mode_of(fresh_cache(model))
        self.context_length = context_length
        self.min_shared_prefix = min_shared_prefix
        self.prefill_step_size = prefill_step_size  # the largest prefill chunk
        # While streams decode, a step that also prefills aims to take at most this long.
        self.decode_gap = decode_gap
        self.min_prefill_chunk = min(min_prefill_chunk, prefill_step_size)
        # Seconds a prompt may wait while shorter ones go first (`schedule`).
        self.max_prefill_wait = max_prefill_wait
        self.release_after = release_after  # idle seconds before pooled memory goes back
        self._inbox: queue.Queue[Request | None] = queue.Queue()  # None: wake up, see `stop`
        self.local_steps = LocalSteps(self._inbox, clock)
        self.generation_config = generation_config or {}  # the model's sampling values
        self.completion_batch_size = completion_batch_size
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size  # None: full-precision KV
        args = getattr(model, "args", None)
        self.vocab_size: int = getattr(args, "vocab_size", None) or len(tokenizer.vocab)
        # Most characters one token stands for: bounds a prompt's tokens from its length.
        self.max_token_chars: int = max(map(len, tokenizer.vocab), default=1)
        self.grammars = GrammarTokenizer(tokenizer, self.vocab_size)  # built on first use
        self.batch_args = {
            "completion_batch_size": completion_batch_size,
            "prefill_batch_size": prefill_batch_size,
            "prefill_step_size": prefill_step_size,
            "stop_tokens": [[t] for t in sorted(tokenizer.eos_token_ids)],
        }
        self._disk_reads = ThreadPoolExecutor(2, thread_name_prefix="disk-read")
        # Where the steps' inputs come from: this process, or rank 0 of a sharded server.
        self.steps: StepSource = self.local_steps
        self.sharded = False  # a rank of a sharded server: a failed step ends the engine
        self.failure: str | None = None  # why a sharded engine ended, for /health
        self.stepping_since: float | None = None  # monotonic start of the step under way
        self.on_failure: Callable[[str], None] | None = None  # told once the engine ended so
        self._requeued: list[Request] = []  # engine thread: admitted again at the next step
        self._release_asked = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = threading.Lock()  # orders a submit against the thread's last take
        self._closed = False
        self.running = 0  # requests admitted and not finished (read by /health)
        self.queued = 0  # requests taken by the thread, waiting for their prefill to start
        self.in_flight = 0  # requests the server admitted and that have not ended (`Slot`)
        self.stats = EngineStats()

    @property
    def clock(self) -> Callable[[], float]:
        """The clock a step's time is read from (on rank 0, when sharded)."""
        return self.local_steps.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.local_steps.clock = clock

    # ---------------------------------------------------------- lifecycle

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

    def flush_cache(self) -> int:
        """Empty the prompt cache, every tenant's namespace; how many namespaces it held.

        Sharded, every rank empties its cache at the same step (the next one)."""
        if self.cache is None:
            return 0
        if self.sharded:
            self.local_steps.flush_asked.set()
            self._inbox.put(None)  # an idle engine steps now
            return len(self.cache.models())
        return self._clear_cache()

    def _clear_cache(self) -> int:
        keys = self.cache.models()
        for key in keys:
            self.cache.clear(key)
        return len(keys)

    def release_memory(self) -> None:
        """Hand pooled memory back to the system as soon as the engine is idle."""
        self._release_asked.set()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted: in the inbox or the batch's queue."""
        return self._inbox.qsize() + self.queued

    # ------------------------------------------------------------ clients

    def cache_key(self, namespace: str | None = None) -> Any:
        """The prompt-cache key of this model for a tenant: tenants never share state."""
        return self.model_id if namespace is None else (self.model_id, namespace)

    def checkpoints_of(self, n: int, marks: tuple[int, ...]) -> tuple[int, ...]:
        """Where a prompt of `n` tokens is stored while prefilling: for a hybrid model, at
        `marks` (the serving layer's message ends) and a token before its end (the point
        the same prompt sent again resumes from); nowhere for others, which resume at any
        token of what they stored."""
        if self.cache is None or self.cache_mode != "checkpointed":
            return ()
        return tuple(sorted({p for p in (*marks, n - 1) if 0 < p < n}))

    def submit(
        self,
        tokens: list[int],
        params: SamplingParams,
        emit: Callable,
        namespace: str | None = None,
    ) -> Request:
        # Decided here, in the parameters a sharded server's other ranks are handed.
        params = replace(params, checkpoints=self.checkpoints_of(len(tokens), params.checkpoints))
        request = Request(list(tokens), params, emit, self.cache_key(namespace))
        with self._closing:
            if self._closed:  # the thread has taken its last request
                self.fail([request], SHARD_LOST if self.failure else SHUTTING_DOWN, "shutdown")
            else:
                self._inbox.put(request)
        return request

    async def stream(
        self, tokens: list[int], params: SamplingParams, namespace: str | None = None
    ) -> AsyncIterator[Event]:
        """Events of one generation; leaving the iteration early cancels it."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone; nobody is listening
                pass

        if self.cache is not None and self.cache.disk is not None and not self._closed:
            # Here, not in the engine's fetch: reading a conversation back from disk
            # holds up no running generation. Its own threads: a slow disk must not hold
            # up the loop's executor, which every request's templating goes through.
            key = self.cache_key(namespace)
            await loop.run_in_executor(self._disk_reads, self.cache.load_from_disk, key, tokens)
        request = self.submit(tokens, params, emit, namespace)
        try:
            while True:
                event = await events.get()
                yield event
                if isinstance(event, Finished | Failed):
                    return
        finally:
            request.cancel()

    # ------------------------------------------------------- engine thread

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
