"""The generation engine: one thread owns MLX and serves every request.

Requests arrive on a queue; the engine thread takes each one's starting state
from the prompt cache, runs all of them together with mlx-lm's
`BatchGenerator` (continuous batching), and streams events back to the asyncio
handlers through `loop.call_soon_threadsafe`, so the event loop never waits on
the model. When a request ends (finished, stopped or cancelled) the KV of its
prompt plus what it generated goes back into the cache for the next turn.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler

from prompt_cache import PackedTokens, PromptCache, fresh_cache
from prompt_cache.radix import common_prefix_length

from .last_logits import last_logits
from .sampling import make_processors, make_sampler
from .text import StopMatcher, token_bytes

log = logging.getLogger("mlx_cache_server.engine")


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: no logprobs; else how many alternatives per token


@dataclass
class Candidate:
    token: int
    text: str
    bytes: bytes  # the token's own bytes: part of a character for some tokens
    logprob: float


@dataclass
class TokenLogprob(Candidate):
    top: list[Candidate] = field(default_factory=list)


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # "stop", "length" or "cancelled"
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500
    type: str = "server_error"


Event = Started | Delta | Finished | Failed


@dataclass
class EngineStats:
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0


@dataclass(eq=False)
class Request:
    """A request as the engine thread sees it; `cancel()` is safe from any thread."""

    tokens: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    cache_key: Any = None  # the prompt-cache model key: this model, in this tenant's namespace
    packed: PackedTokens = field(init=False)  # `tokens`, packed once for every lookup and insert
    cancelled: bool = False
    uid: int = -1
    generated: int = 0
    detok: Any = None
    stops: StopMatcher | None = None
    prefilling: bool = False
    boundary: int = 0  # tokens of a prefix shared with waiting requests, cached once prefilled
    followers: list[Request] = field(default_factory=list)  # waiting for that prefix
    fault: Exception | None = None  # raised by this request's own sampler or processors
    ended: bool = False  # its last event (Finished or Failed) was sent

    def __post_init__(self) -> None:
        self.packed = PackedTokens.of(self.tokens)

    def cancel(self) -> None:
        self.cancelled = True

    def end(self, event: Finished | Failed) -> None:
        """Send the last event; a request ends once, whatever fails around it."""
        if not self.ended:
            self.ended = True
            self.emit(event)


def _guarded(request: Request, fn: Callable, fallback: Callable) -> Callable:
    """`fn` for one row of the batch, with what it raises kept on its request.

    A request's sampler and logits processors run inside the batch's step, so an
    exception from one would abort the step for every request in it. Guarded, the
    step completes (this row gets `fallback`'s harmless result) and the engine then
    fails that request alone.
    """

    def call(*args: Any) -> Any:
        if request.fault is None:
            try:
                return fn(*args)
            except Exception as e:
                request.fault = e
        return fallback(*args)

    return call


def _unchanged(_: mx.array, logits: mx.array) -> mx.array:
    return logits


def _with_followers(requests: list[Request]) -> list[Request]:
    out = []
    for request in requests:
        out += [request, *_with_followers(request.followers)]
    return out


def _release_memory() -> None:
    """Idle for a while: hand pooled memory back to the system.

    MLX pools freed buffers, and glibc keeps freed heap pages; both would hold a
    busy hour's peak for as long as the server lives.
    """
    mx.clear_cache()
    _trim_heap()


def _trim_heap() -> None:
    # Heap pages freed between the cache's long-lived segments stay resident
    # until trimmed. This keeps MLX's pool (reused by the next request as is),
    # so it is cheap enough (about 6 ms) to run whenever the engine goes idle.
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()
_M_MMAP_THRESHOLD, _M_MMAP_MAX = -3, -4


def unmap_large_blocks(threshold: int = 1 << 20, max_blocks: int = 32768) -> bool:
    """Have glibc map every block of `threshold` bytes or more on its own, for the process.

    glibc does that by default, but raises the threshold (up to 32 MiB) each time
    such a block is freed; after that, a batch's multi-MiB KV buffers come from its
    heaps, where freed ones stay resident. Pinned, they go back to the system when
    freed: 16 concurrent chats (bench/multiturn.py, workload 2) peaked at about
    1445 MiB instead of 1730. At 1 MiB, blocks the size of one turn's activations
    or a cache segment still come from the heaps (the idle trim returns those):
    pinned at 128 KiB, every turn faulted them in afresh, about 25 ms a warm turn
    (bench/warm_paired.py), for a peak at most 13 MiB lower (bench/overflow_sweep.py).
    Past `max_blocks` mapped blocks glibc uses its heaps again, well under the
    kernel's limit on mappings (65530 by default). Call it before loading the
    model; False where the C library is not glibc.
    """
    if _libc is None:
        return False
    return bool(
        _libc.mallopt(_M_MMAP_THRESHOLD, threshold) and _libc.mallopt(_M_MMAP_MAX, max_blocks)
    )


def limit_buffer_pool(limit: int = 4 << 20) -> bool:
    """On MLX's CPU backend, pool at most `limit` bytes of freed buffers.

    MLX keeps freed buffers for reuse, by default up to its memory limit. Between
    requests that pool held about 30 MiB of one prefill's activations, on top of the
    cache's budget: workload 3 of bench/overflow_sweep.py at 0.6 of its budget peaked
    at 821 MiB against 790 with 4 MiB pooled (786 with none, 794 with 8 MiB). Warm
    turns paired against the default pool (25 pairs, twice) took 1.6-2.1% longer, with
    none pooled 6%: on the CPU, malloc serves a fresh buffer nearly as fast. Metal and
    CUDA, not measured here and where a fresh buffer costs a driver call, keep MLX's
    default. False if not on the CPU.
    """
    if mx.default_device().type != mx.cpu:
        return False
    mx.set_cache_limit(limit)
    return True


def _packed(request: Request, tokens: list[int]) -> PackedTokens | list[int]:
    """A state's tokens for the cache: the request's prompt was packed on arrival.

    A request's state holds a prefix of its prompt (a shared prefix cached early)
    or the prompt and what was generated after it; only the generated part is
    packed here. The check costs a list compare, far less than packing.
    """
    prompt, n = request.tokens, len(request.tokens)
    if len(tokens) <= n:
        if tokens == prompt[: len(tokens)]:
            return request.packed.prefix(len(tokens))
    elif tokens[:n] == prompt:
        return request.packed.extend(tokens[n:])
    return list(tokens)  # not this request's sequence after all: pack it whole


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
        min_shared_prefix: int = 32,
        release_after: float = 2.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.cache = cache
        self.context_length = context_length
        self.min_shared_prefix = min_shared_prefix
        self.prefill_step_size = prefill_step_size
        self.release_after = release_after  # idle seconds before pooled memory goes back
        self.completion_batch_size = completion_batch_size
        args = getattr(model, "args", None)
        self.vocab_size: int = getattr(args, "vocab_size", None) or len(tokenizer.vocab)
        # Most characters one token stands for: bounds a prompt's tokens from its length.
        self.max_token_chars: int = max(map(len, tokenizer.vocab), default=1)
        self._batch_args = {
            "completion_batch_size": completion_batch_size,
            "prefill_batch_size": prefill_batch_size,
            "prefill_step_size": prefill_step_size,
            "stop_tokens": [[t] for t in sorted(tokenizer.eos_token_ids)],
        }
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._stopping = threading.Event()
        self._release_asked = threading.Event()
        self._thread: threading.Thread | None = None
        self.running = 0  # requests admitted and not finished (read by /health)
        self.in_flight = 0  # requests the server admitted and that have not ended (`Slot`)
        self.stats = EngineStats()

    # ---------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def release_memory(self) -> None:
        """Hand pooled memory back to the system as soon as the engine is idle."""
        self._release_asked.set()

    @property
    def waiting(self) -> int:
        return self._inbox.qsize()

    # ------------------------------------------------------------ clients

    def cache_key(self, namespace: str | None = None) -> Any:
        """The prompt-cache key of this model for a tenant: tenants never share state."""
        return self.model_id if namespace is None else (self.model_id, namespace)

    def submit(
        self,
        tokens: list[int],
        params: SamplingParams,
        emit: Callable,
        namespace: str | None = None,
    ) -> Request:
        request = Request(list(tokens), params, emit, self.cache_key(namespace))
        self._inbox.put(request)
        if self._stopping.is_set() and not self.alive:  # no thread will take it any more
            self._fail([*self._take(block=False)], "The server is shutting down.")
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

    def _loop(self) -> None:
        gen: BatchGenerator | None = None
        active: dict[int, Request] = {}
        idle_since: float | None = None  # set when the last request ended; None once released
        while not self._stopping.is_set():
            new: list[Request] = []
            try:
                new = self._take(block=not active)
                if new:
                    if gen is None:
                        gen = BatchGenerator(self.model, **self._batch_args)
                    self._intake(gen, new, active)
                if active:
                    idle_since = None
                elif self._release_asked.is_set() or (
                    idle_since is not None and time.monotonic() - idle_since > self.release_after
                ):
                    # Only after a pause: back-to-back turns would each pay about 40 ms
                    # (135M model) to fault freshly allocated buffers back in.
                    self._release_asked.clear()
                    _release_memory()
                    idle_since = None
                if gen is None or not active:
                    continue
                self._drop_cancelled(gen, active)
                if active:
                    self._step(gen, active)
                    self._drop_faulted(gen, active)
                if not active:  # the last request just left
                    _trim_heap()
                    idle_since = time.monotonic()
            except Exception:  # keep serving: fail what was running, start afresh
                # Whatever a request supplies runs guarded (`_guarded`), so what lands here
                # is the batch's own failure. Requests taken but not yet admitted fail too:
                # nobody is left waiting for an event that will never come.
                log.exception("generation failed")
                self._fail([*new, *active.values()], "Generation failed on the server. Retry.")
                active.clear()
                if gen is not None:
                    gen.close()
                gen = None
                idle_since = time.monotonic()  # what the failed batch held can go back too
            finally:
                self.running = len(active)
        self._fail([*active.values(), *self._take(block=False)], "The server is shutting down.")
        if gen is not None:
            gen.close()
        mx.synchronize()  # finish the cache's asynchronous copies before the thread ends

    def _fail(self, requests: list[Request], message: str) -> None:
        """End these requests and those waiting on them with `message`, each once."""
        for request in dict.fromkeys(_with_followers(requests)):
            if not request.ended:
                request.end(Failed(message))
                self.stats.failed += 1

    def _step(self, gen: BatchGenerator, active: dict[int, Request]) -> None:
        """One prefill or decode step of the batch, its results handled.

        A method of its own so the step's responses die with it: a finished
        sequence's response holds its whole KV, which, left in a loop variable,
        stayed alive until the next step, while the next request's own KV was
        fetched and prefilled (one conversation's KV over the cache's budget).
        """
        prefills, responses = gen.next()
        for progress in prefills:
            self._on_prefill(gen, progress, active)
        for response in responses:
            if active[response.uid].fault is None:
                self._on_token(gen, response, active)
            elif response.finish_reason is not None:  # out of the batch already
                self._fail_faulted(active.pop(response.uid))

    def _drop_faulted(self, gen: BatchGenerator, active: dict[int, Request]) -> None:
        """Take requests whose own sampler or processors raised out of the batch, and fail them."""
        faulted = [uid for uid, request in active.items() if request.fault is not None]
        if faulted:
            gen.remove(faulted)
            for uid in faulted:
                self._fail_faulted(active.pop(uid))

    def _fail_faulted(self, request: Request) -> None:
        log.error("a request's sampling failed: %r", request.fault)
        followers, request.followers = request.followers, []
        request.end(Failed("Sampling failed for this request's parameters."))
        self.stats.failed += 1
        for follower in followers:  # they wait for a prefix, not for this request's output
            self._inbox.put(follower)

    def _take(self, block: bool) -> list[Request]:
        taken = []
        try:
            if block:
                taken.append(self._inbox.get(timeout=0.1))
            while True:
                taken.append(self._inbox.get_nowait())
        except queue.Empty:
            return taken

    def _intake(self, gen: BatchGenerator, new: list[Request], active: dict[int, Request]) -> None:
        """Admit new requests; those sharing an uncached prefix wait for it to be computed once.

        When several requests share a prefix the cache does not hold yet (16 chats
        with one system prompt, say), the first one (the leader) is admitted with
        its prompt cut at that prefix; once prefilled, the prefix goes into the
        cache and the others are admitted and reuse it, instead of each
        prefilling it in parallel.
        """
        if self.cache is None:
            for request in new:
                self._admit(gen, request, active, alone=len(new) == 1)
            return
        running = [r for r in active.values() if r.prefilling]
        leaders: list[Request] = []
        for request in new:
            _, cached = self.cache.peek(request.cache_key, request.packed)
            leader, shared = None, 0
            for candidate in running + leaders:
                if candidate.cache_key != request.cache_key:
                    continue  # another tenant's prefix is not to be shared
                n = common_prefix_length(request.tokens, candidate.tokens)
                n = min(n, len(request.tokens) - 1, len(candidate.tokens) - 1)
                if n - cached >= self.min_shared_prefix and n > shared:
                    leader, shared = candidate, n
            if leader is None:
                leaders.append(request)
                continue
            leader.followers.append(request)
            if leader in leaders:  # not admitted yet: cut its prompt where the sharing ends
                leader.boundary = min(leader.boundary or shared, shared)
        for request in leaders:
            self._admit(gen, request, active, alone=len(leaders) == 1)

    def _on_prefill(self, gen: BatchGenerator, progress: Any, active: dict[int, Request]) -> None:
        request = active.get(progress.uid)
        if request is None:
            return
        if progress.end_of_prompt:
            request.prefilling = False
        if request.followers and (progress.end_of_segment or progress.end_of_prompt):
            self._store(request, gen.extract_cache([progress.uid]).get(progress.uid))
            self._release(gen, request, active)

    def _release(self, gen: BatchGenerator, leader: Request, active: dict[int, Request]) -> None:
        followers, leader.followers = leader.followers, []
        for request in followers:
            self._admit(gen, request, active, alone=len(followers) == 1)

    def _admit(
        self, gen: BatchGenerator, request: Request, active: dict[int, Request], alone: bool
    ) -> None:
        try:
            self._start(gen, request, active, alone)
        except Exception:  # this request and those waiting on it fail; the batch runs on
            log.exception("admitting a request failed")
            self._fail([request], "Generation failed on the server. Retry.")
            request.followers = []

    def _start(
        self, gen: BatchGenerator, request: Request, active: dict[int, Request], alone: bool
    ) -> None:
        if request.cancelled:
            request.end(Finished("cancelled", 0))
            self._release(gen, request, active)
            return
        tokens, p = request.tokens, request.params
        cached, n = None, 0
        if self.cache is not None:
            found = self.cache.fetch(request.cache_key, request.packed)
            cached, n = found.cache, found.n_cached
        request.detok = self.tokenizer.detokenizer
        request.stops = StopMatcher(p.stop)
        sampler = make_sampler(p.temperature, p.top_p, p.top_k, p.min_p, p.seed)
        if sampler is not greedy_sampler:  # one shared argmax lets the batch sample in one call
            sampler = _guarded(request, sampler, greedy_sampler)
        processors = [
            _guarded(request, processor, _unchanged)
            for processor in make_processors(p.logit_bias, p.presence_penalty, p.frequency_penalty)
        ]
        self.stats.admitted += 1
        request.emit(Started(prompt_tokens=len(tokens), cached_tokens=n))
        # Prefilling here holds up the batch's decoding until done: for one step's
        # worth of tokens that is what BatchGenerator does too; for more, only
        # when nobody else is running.
        short = len(tokens) - n <= self.prefill_step_size
        if alone and not request.followers and (short or not active):
            self._admit_prefilled(gen, request, active, cached, n, sampler, processors)
            return
        segments = [tokens[n:]]
        if n < request.boundary < len(tokens):
            segments = [tokens[n : request.boundary], tokens[request.boundary :]]
        (request.uid,) = gen.insert_segments(
            [segments],
            max_tokens=[p.max_tokens],
            caches=[cached],
            all_tokens=[tokens[:n]],
            samplers=[sampler],
            logits_processors=[processors],
        )
        request.prefilling = True
        active[request.uid] = request

    def _admit_prefilled(
        self,
        gen: BatchGenerator,
        request: Request,
        active: dict[int, Request],
        cache: list[Any] | None,
        n: int,
        sampler: Any,
        processors: list,
    ) -> None:
        """Prefill the uncached tokens here and sample the first token from their logits.

        `BatchGenerator` prefills all but the last prompt token and produces the
        first token with a separate one-token decode step: on a bandwidth-bound
        machine that step costs as much as prefilling dozens of tokens (about
        90 ms for the 135M model on this CPU). A request admitted on its own
        skips it; it then joins the batch with its first token as its prompt.
        Requests admitted together keep the batched path, which prefills them in
        one forward pass.
        """
        tokens, p = request.tokens, request.params
        cache = cache or fresh_cache(self.model)
        step = self.prefill_step_size
        with mx.stream(gen.stream):
            *chunks, last = range(n, len(tokens), step)
            for at in chunks:  # evaluated one by one: activations stay one step's size
                self.model(mx.array(tokens[at : at + step])[None], cache=cache)
                mx.eval([c.state for c in cache])
            logits = last_logits(self.model, mx.array(tokens[last:])[None], cache)
            context = mx.array(tokens, dtype=mx.int32)
            for processor in processors:
                logits = processor(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = sampler(logprobs)
            mx.eval(token, logprobs)
        if request.fault is not None:
            self._fail_faulted(request)
            return
        first = int(token.item())
        finish = "stop" if first in self.tokenizer.eos_token_ids else None
        if finish is None and p.max_tokens <= 1:
            finish = "length"
        if self._deliver(request, first, logprobs[0], finish, lambda: (cache, tokens), active):
            return
        (request.uid,) = gen.insert(
            [[first]],
            max_tokens=[p.max_tokens - 1],
            caches=[cache],
            all_tokens=[list(tokens)],  # BatchGenerator appends to it
            samplers=[sampler],
            logits_processors=[processors],
        )
        active[request.uid] = request
        # Cached now, not only when it ends: requests that arrived during this
        # prefill (15 chats opening with this system prompt, say) reuse it at once.
        self._store(request, (cache, tokens))

    def _on_token(self, gen: BatchGenerator, r: Any, active: dict[int, Request]) -> None:
        def state() -> tuple[list[Any], list[int]] | None:
            if r.finish_reason is None:  # stopped by a stop string: take it out of the batch
                return gen.remove([r.uid], return_prompt_caches=True).get(r.uid)
            return r.prompt_cache, r.all_tokens

        self._deliver(active[r.uid], r.token, r.logprobs, r.finish_reason, state, active)

    def _deliver(
        self,
        request: Request,
        token: int,
        logprobs: mx.array,
        finish_reason: str | None,
        state: Callable[[], tuple[list[Any], list[int]] | None],
        active: dict[int, Request],
    ) -> bool:
        """Send one generated token on; when it ends the request, cache its KV and say so."""
        request.generated += 1
        at_eos = finish_reason == "stop"  # an end token: not part of the text
        if not at_eos:
            request.detok.add_token(token)
        if finish_reason is not None:
            request.detok.finalize()
        text = request.stops.feed(request.detok.last_segment)
        lps = [] if at_eos else self._logprobs(request, token, logprobs)
        # The client hears the end first; the cache insert follows on this same thread,
        # so no later request can be admitted before it is done.
        if request.stops.stopped:
            kv = state()
            self._finish(request, active, Delta(text, lps), "stop")
            self._store(request, kv)
            return True
        if finish_reason is not None:
            text += request.stops.flush()
            self._finish(request, active, Delta(text, lps), finish_reason)
            self._store(request, state())
            return True
        if text or lps:
            request.emit(Delta(text, lps))
        return False

    def _finish(self, request: Request, active: dict, last: Delta, reason: str) -> None:
        if last.text or last.logprobs:
            request.emit(last)
        request.end(Finished(reason, request.generated))
        active.pop(request.uid, None)
        self.stats.finished += 1

    def _drop_cancelled(self, gen: BatchGenerator, active: dict[int, Request]) -> None:
        gone = [uid for uid, request in active.items() if request.cancelled]
        if not gone:
            return
        caches = gen.remove(gone, return_prompt_caches=True)
        for uid in gone:
            self._store(active[uid], caches.get(uid))
            request = active.pop(uid)
            request.end(Finished("cancelled", request.generated))
            self.stats.cancelled += 1
            self._release(gen, request, active)

    def _store(self, request: Request, state: tuple[list[Any], list[int]] | None) -> None:
        """Put a sequence's KV into the cache, for the next turn or for waiting requests."""
        if self.cache is None or state is None:
            return
        cache, tokens = state
        if not tokens or not cache:
            return
        try:
            self.cache.insert(request.cache_key, _packed(request, tokens), cache)
        except ValueError as e:  # never worth failing a request over
            log.warning("not caching a sequence of %d tokens: %s", len(tokens), e)

    def _logprobs(self, request: Request, token: int, lp: mx.array) -> list[TokenLogprob]:
        k = request.params.logprobs
        if k is None:
            return []
        top: list[Candidate] = []
        if k > 0:
            ids = mx.argpartition(-lp, k - 1)[:k]
            vals = lp[ids]
            order = mx.argsort(-vals)
            ids, vals = ids[order].tolist(), vals[order].tolist()
            top = [self._candidate(i, v) for i, v in zip(ids, vals, strict=True)]
        token = int(token)
        chosen = self._candidate(token, lp[token].item())
        return [TokenLogprob(**chosen.__dict__, top=top)]

    def _candidate(self, token: int, logprob: float) -> Candidate:
        text = self.tokenizer.decode([token])
        return Candidate(token, text, token_bytes(self.tokenizer, token), logprob)
