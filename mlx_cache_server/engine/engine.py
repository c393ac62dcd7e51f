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
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from mlx_cache_server.prompt_cache import PromptCache, fresh_cache
from mlx_cache_server.prompt_cache.layers import mode_of

from .batch import Batch
from .constraint import GrammarTokenizer
from .draft_model import DraftModel
from .events import EngineStats, Event, Failed, Finished, SamplingParams
from .positions import PLAIN
from .quantized_kv import QuantizedKVRunner
from .replies import BUDGET, RecentReplies
from .request import Request
from .steps import LocalSteps, StepSource
from .thread import StepLoop
from .wiring import BatchSettings, Fail, Outlet, Requeue


class Engine:
    """A model's generation as its clients see it (`submit`, `stream`); it has the thread
    that runs the steps (`runner`, a `thread.StepLoop`), whose state the properties show."""

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
        speculation: bool = True,
        draft: DraftModel | None = None,
        vision: Any = None,
        no_images: str = "it is not a vision model",
    ) -> None:
        self.model = model
        # A vision model's images (`models.vision_load.Vision`), or why it takes none.
        self.vision, self.no_images = vision, no_images
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.cache = cache
        # What drafts are made from besides a sequence's own: nothing kept without drafts.
        self.replies = RecentReplies(BUDGET if speculation else 0)
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
            "speculation": speculation,
            "draft": draft,
            # Where a pass's tokens stand: a vision model's images may move them.
            "positions": vision.positions if vision is not None else PLAIN,
        }
        self._disk_reads = ThreadPoolExecutor(2, thread_name_prefix="disk-read")
        self.in_flight = 0  # requests the server admitted and that have not ended (`Slot`)
        self.stats = EngineStats()
        self.runner = StepLoop(self.stats, clock=clock, release_after=release_after)

    def _new_batch(self, fail: Fail, requeue: Requeue) -> Batch | QuantizedKVRunner:
        """The batch the thread runs requests in (`fail`, `requeue`: the thread's), from the
        model and settings as they are at its first request (or after a failed step)."""
        outlet = Outlet(self.tokenizer, self.cache, self.replies, self.stats)
        settings = BatchSettings(
            self.batch_args, self.completion_batch_size, self.prefill_step_size,
            self.min_prefill_chunk, self.decode_gap, self.max_prefill_wait,
            self.min_shared_prefix,
        )  # fmt: skip
        if self.kv_bits is None:
            return Batch(self.model, outlet, settings, fail, requeue)
        return QuantizedKVRunner(
            self.model, outlet, settings, fail, self.kv_group_size, self.kv_bits
        )

    def start(self) -> None:
        self.runner.start(self._new_batch, self._clear_cache)

    def run(self) -> None:
        """Run the steps on this thread until the engine stops (a sharded server's other
        ranks, which do nothing else)."""
        self.runner.run(self._new_batch, self._clear_cache)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running or queued fail ("shutting down")."""
        self.runner.stop(timeout)

    def abandon(self, why: str) -> None:
        """End every request now, from any thread (`StepLoop.abandon`)."""
        self.runner.abandon(why)

    @property
    def alive(self) -> bool:
        return self.runner.alive

    @property
    def failure(self) -> str | None:
        """Why a sharded engine ended, for /health; None while it serves."""
        return self.runner.failure

    @property
    def stepping_since(self) -> float | None:
        """Monotonic start of the step under way; None between steps."""
        return self.runner.stepping_since

    @property
    def running(self) -> int:
        """Requests admitted and not finished (read by /health)."""
        return self.runner.running

    @property
    def local_steps(self) -> LocalSteps:
        """This process's step inputs (what rank 0 of a sharded server hands the others)."""
        return self.runner.local_steps

    @property
    def steps(self) -> StepSource:
        """Where the steps' inputs come from: this process, or rank 0 of a sharded server."""
        return self.runner.steps

    @steps.setter
    def steps(self, steps: StepSource) -> None:
        self.runner.steps = steps

    @property
    def sharded(self) -> bool:
        """A rank of a sharded server: a failed step ends the engine."""
        return self.runner.sharded

    @sharded.setter
    def sharded(self, sharded: bool) -> None:
        self.runner.sharded = sharded

    @property
    def on_failure(self) -> Callable[[str], None] | None:
        """Told once the engine ended, from the engine's thread."""
        return self.runner.on_failure

    @on_failure.setter
    def on_failure(self, on_failure: Callable[[str], None] | None) -> None:
        self.runner.on_failure = on_failure

    @property
    def release_after(self) -> float:
        """Idle seconds before pooled memory goes back."""
        return self.runner.release_after

    @release_after.setter
    def release_after(self, seconds: float) -> None:
        self.runner.release_after = seconds

    @property
    def clock(self) -> Callable[[], float]:
        """The clock a step's time is read from (on rank 0, when sharded)."""
        return self.runner.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.runner.clock = clock

    # ------------------------------------------------------------ cache

    def flush_cache(self) -> int:
        """Empty the prompt cache, every tenant's namespace; how many namespaces it held.
        Sharded, every rank empties its cache at the same step (the next one)."""
        if self.cache is not None and self.runner.sharded:
            self.runner.ask_flush()
            return len(self.cache.models())
        return self._clear_cache()

    def _clear_cache(self) -> int:
        if self.cache is None:
            return 0
        keys = self.cache.models()
        for key in keys:
            self.cache.clear(key)
        self.replies.clear()
        return len(keys)

    def release_memory(self) -> None:
        """Hand pooled memory back to the system as soon as the engine is idle."""
        self.runner.ask_release()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted: in the inbox or the batch's queue."""
        return self.runner.waiting

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
        self.runner.accept(request)
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

        if self.cache is not None and self.cache.disk is not None and not self.runner.closed:
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
