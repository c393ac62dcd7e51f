"""The running batch: admission into mlx-lm's `BatchGenerator`, its steps, and exits.

Owned by the engine thread alone. A request enters through `intake` and waits in
`queue` until `schedule.choose` starts it (shortest prompt first, with a bounded
wait); admitted (planned by `admission.plan_admission`), it is prefilled on its
own (`prefill.prefill_alone`) or with others by the generator in chunks (the last
one on its own again when it is the only prompt left: `_last_chunk`), yields one token
per step (`output`), and leaves finished, stopped, cancelled or failed; its KV goes
into the prompt cache on the way out, and a shared prefix as soon as it is prefilled.
A sequence prefilled on its own decodes in a second generator, the side batch, when
joining the main one would pad it mostly with nothing (`placement`).

Invariants: `active` maps the generator's uid of every admitted, unended request
to it, the side batch's uids from `SIDE_UIDS` on and the main one's below; prompts
are prefilled in the main batch only; `queue` holds the requests taken and not yet
admitted, with when they came; a request that leaves `active` or `queue` has been
ended (`Request.end`) or admitted; a failure that belongs to one request (its
sampling, its admission) ends that request only.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from prompt_cache import as_fresh, fresh_cache

from .admission import plan_admission
from .chunking import StepCosts, chunk_size
from .events import Failed, Finished, Started
from .generator import MixedGenerator
from .output import next_output
from .placement import MAIN, place
from .prefill import prefill_alone
from .request import Request, with_followers
from .schedule import Waiting, choose, join_limit
from .steps import Measured
from .text import StopMatcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from .host import Host

log = logging.getLogger("mlx_cache_server.engine")

State = tuple[list[Any], list[int]]  # a sequence's KV cache and its tokens
SIDE_UIDS = 1 << 48  # the side batch numbers its sequences from here: one `active` for both


class Batch:
    def __init__(self, engine: Host) -> None:
        self.engine = engine
        self.gen = MixedGenerator(engine.model, **engine.batch_args)
        self.side = MixedGenerator(engine.model, **engine.batch_args)
        self.side._uid_count = SIDE_UIDS  # mlx-lm numbers from this counter
        self.active: dict[int, Request] = {}
        self.queue: list[tuple[Request, float]] = []
        self._replan = False  # new in the queue or newly prefilling: look for shared prefixes
        self.costs = StepCosts()  # what the steps measured (on rank 0, when sharded)
        self.cost: Measured | None = None  # the last step's, for the next step's inputs
        self.now = 0.0  # the step's time, from its inputs: the same on every rank

    def close(self) -> None:
        # Each generator restores the wired limit it found (Metal): the side batch's is
        # the one the main batch set, so the main batch restores the system's last.
        self.side.close()
        self.gen.close()

    @property
    def busy(self) -> bool:
        return bool(self.active or self.queue)

    def everyone(self) -> list[Request]:
        return with_followers([*self.active.values(), *(r for r, _ in self.queue)])

    # -------------------------------------------------------------- entering

    def intake(self, new: list[Request]) -> None:
        self.queue += [(request, self.now) for request in new]
        self._replan = True
        self._start_queued()

    def _start_queued(self) -> None:
        """Admit the queued requests `schedule.choose` starts now; with nothing left
        running, more until something runs or nothing waits."""
        while self.queue:
            self._follow_prefilling()
            prefilling = [r.left for r in self._prefilling()]
            line = [Waiting(r, self._uncached(r), t) for r, t in self.queue]
            limit = join_limit(*self._step_and_token_costs())
            chosen = choose(line, prefilling, self.chunk(budget=True), self.now,
                            self.engine.max_prefill_wait, limit)  # fmt: skip
            if not chosen:
                return
            self.queue = [(r, t) for r, t in self.queue if all(r is not c for c in chosen)]
            try:
                self._plan(chosen)
            except Exception:  # out of the queue and maybe not admitted: answer them here
                self.engine.fail(chosen, "Generation failed on the server. Retry.")
                raise
            if self.active:
                return

    def _step_and_token_costs(self) -> tuple[float | None, float | None]:
        """A step's fixed cost, read low, and a prompt token's at the depth last measured:
        when unsure, prompts go one after another rather than make each other wait."""
        c = self.costs
        per_token = c.per_token(c.prefill[-1][0]) if c.prefill else None
        if c.decode is None or per_token is None:
            return None, None
        return min(c.decode, c.last_decode or c.decode), per_token

    def _follow_prefilling(self) -> None:
        """Queued requests sharing a prefix with a prompt being prefilled wait for it
        instead of their turn: once it is cached they start from it (`admission`)."""
        cache, leaders = self.engine.cache, self._prefilling()
        if cache is None or not leaders or not self._replan:
            return
        self._replan = False
        plan = plan_admission(
            [r for r, _ in self.queue],
            leaders,
            cached=self._held,
            min_shared=self.engine.min_shared_prefix,
        )
        following = [r for r, leader in plan.leader_of.items() if any(leader is x for x in leaders)]
        for request in following:
            plan.leader_of[request].followers.append(request)
        self.queue = [(r, t) for r, t in self.queue if all(r is not f for f in following)]

    def _uncached(self, request: Request) -> int:
        return len(request.tokens) - self._held(request)

    def _held(self, request: Request) -> int:
        """Tokens of the request's prompt the cache holds now."""
        cache = self.engine.cache
        return cache.peek(request.cache_key, request.packed)[1] if cache is not None else 0

    def _plan(self, new: list[Request]) -> None:
        cache = self.engine.cache
        if cache is None:
            for request in new:
                self._admit(request, alone=len(new) == 1)
            return
        prefilling = self._prefilling()
        plan = plan_admission(
            new,
            prefilling,
            cached=self._held,
            min_shared=self.engine.min_shared_prefix,
        )
        for follower, leader in plan.leader_of.items():
            leader.followers.append(follower)
        for leader, boundary in plan.boundary.items():
            leader.boundary = boundary
        for request in plan.admit:
            self._admit(request, alone=len(plan.admit) == 1)

    def _admit(self, request: Request, alone: bool) -> None:
        try:
            self._start(request, alone)
        except Exception:
            log.exception("admitting a request failed")
            self._fail_start(request)

    def _fail_start(self, request: Request) -> None:
        """Fail a request whose start (its admission, its last chunk) raised; the batch runs
        on (sharded: on every rank alike, or the next step's handover finds the ranks apart:
        `step_digest`)."""
        if self.active.pop(request.uid, None) is not None:  # in the batch already
            self._remove([request.uid])
        followers, request.followers = request.followers, []
        self.engine.fail([request], "Generation failed on the server. Retry.")
        for follower in followers:  # other users' requests: they wait for a prefix only
            self.engine.requeue(follower)

    def _start(self, request: Request, alone: bool) -> None:
        engine = self.engine
        if request.cancelled:
            request.end(Finished("cancelled", 0))
            self._release(request)
            return
        tokens, p = request.tokens, request.params
        cached, n = None, 0
        if engine.cache is not None:
            found = engine.cache.fetch(request.cache_key, request.packed)
            cached, n = found.cache, found.n_cached
        request.detok = engine.tokenizer.detokenizer
        request.stops = StopMatcher(p.stop)
        sampler, processors = request.sampling()
        engine.stats.admitted += 1
        request.emit(Started(prompt_tokens=len(tokens), cached_tokens=n))
        # Prefilling here holds up the batch's decoding until done: for one step's
        # worth of tokens that is what BatchGenerator does too. A longer prompt goes in
        # chunks, so that shorter ones arriving meanwhile can start beside it.
        short = len(tokens) - n <= self.chunk(joining=1, depth=n)
        if alone and not request.followers and short:
            self._start_alone(request, cached or fresh_cache(engine.model), n, sampler, processors)
            return
        marks = (request.boundary, *request.params.checkpoints)
        cuts = sorted({p for p in marks if n < p < len(tokens)})
        segments = [tokens[a:b] for a, b in zip([n, *cuts], [*cuts, len(tokens)], strict=True)]
        (request.uid,) = self.gen.insert_segments(
            [segments],
            max_tokens=[p.max_tokens],
            # Nothing cached: a fresh cache all the same, so the batch hands the prompt out
            # as views with room to go on in place (`_take_out`), not a cut copy.
            caches=[cached or fresh_cache(engine.model)],
            all_tokens=[tokens[:n]],
            samplers=[sampler],
            logits_processors=[processors],
        )
        request.prefilling = True
        request.left = len(tokens) - n
        self.active[request.uid] = request
        self._replan = True

    def _start_alone(self, request: Request, cache: list, n: int, sampler, processors) -> float:
        """Prefill the prompt after its first `n` tokens in `cache` and sample its first
        token, then let it decode; the seconds the prefill took."""
        engine, tokens = self.engine, request.tokens
        start = time.perf_counter()

        def checkpoint(at: int) -> None:
            self._store(request, (cache, tokens[:at]))

        with mx.stream(self.gen.stream):
            first, logprobs = prefill_alone(
                engine.model, tokens, cache, n, engine.prefill_step_size, sampler, processors,
                request.params.checkpoints, checkpoint,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        if request.fault is not None:
            self._fail_faulted(request)
            return seconds
        finish = "stop" if first in engine.tokenizer.eos_token_ids else None
        if finish is None and request.params.max_tokens <= 1:
            finish = "length"
        if self._deliver(request, first, logprobs, finish, lambda: (cache, tokens)):
            return seconds
        gen = self.gen if self._place(len(tokens)) == MAIN else self.side
        (request.uid,) = gen.insert(
            [[first]],
            max_tokens=[request.params.max_tokens - 1],
            caches=[cache],
            all_tokens=[list(tokens)],  # BatchGenerator appends to it
            samplers=[sampler],
            logits_processors=[processors],
        )
        self.active[request.uid] = request
        # Cached now, not only when it ends: requests that arrived during this
        # prefill (chats opening with this system prompt, say) reuse it at once.
        self._store(request, (cache, tokens))
        return seconds

    def _place(self, length: int) -> int:
        """Which batch a sequence of `length` tokens decodes in (`placement.place`)."""
        main: list[int] = []
        side: list[int] = []
        for uid, r in self.active.items():
            if not r.prefilling:
                (side if uid >= SIDE_UIDS else main).append(len(r.tokens) + r.generated)
        return place(length, main, side, self.engine.completion_batch_size)

    def _remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """`BatchGenerator.remove` over both batches: each takes out its own."""
        out: dict[int, Any] = {}
        for gen, own in ((self.gen, [u for u in uids if u < SIDE_UIDS]),
                         (self.side, [u for u in uids if u >= SIDE_UIDS])):  # fmt: skip
            if own:
                out.update(gen.remove(own, return_prompt_caches=return_prompt_caches))
        return out

    def _release(self, leader: Request) -> None:
        """Admit those waiting for `leader`'s prefix: it is cached, or will never be."""
        followers, leader.followers = leader.followers, []
        for request in followers:
            self._admit(request, alone=len(followers) == 1)

    # ----------------------------------------------------------------- steps

    def step(self) -> None:
        """One prefill or decode step of the batch (and a decode step of the side batch),
        its results handled.

        A method of its own so the step's responses die with it: a finished
        sequence's response holds its whole KV, which, left in a loop variable,
        would stay alive while the next request's own KV is fetched and prefilled.
        """
        self.cost = None
        self._start_queued()
        if not self.active:
            return
        self.gen.prefill_step_size = chunk = self.chunk()
        depth = self._prefill_depth(chunk)
        last = self._last_chunk(chunk)
        taken = self._take_out(last) if last else None
        with self.gen.stats() as stats:  # mlx-lm's own counters, over this step
            prefills, responses = self.gen.next()
        self._handle(prefills, responses)
        seconds, prompt_tokens = stats.wall_time, stats.prompt_tokens
        decoded = stats.generation_steps > 0
        if self._sided():  # after the main batch's tokens are out: they need not wait for it
            with self.side.stats() as side:
                side_prefills, side_responses = self.side.next()
            self._handle(side_prefills, side_responses)
            seconds, decoded = seconds + side.wall_time, decoded or side.generation_steps > 0
        if last is not None:  # after the streams' tokens are out: they need not wait for it
            left, took = last.left, self._finish_prefill(last, *taken)
            if took is not None:  # not failed: a measurement
                seconds, prompt_tokens = seconds + took, prompt_tokens + left
        self.cost = Measured(seconds, prompt_tokens, decoded, depth)
        self._drop_faulted()

    def _handle(self, prefills: list[Any], responses: list[Any]) -> None:
        """A generator's step's results: prompts' progress, then each sequence's token."""
        for progress in prefills:
            self._on_prefill(progress)
        for r in responses:
            request = self.active[r.uid]
            if request.fault is not None:
                if r.finish_reason is not None:  # out of the batch already
                    self._fail_faulted(self.active.pop(r.uid))
                continue

            def state(r: Any = r) -> State | None:
                if r.finish_reason is None:  # stopped by a stop string: take it out
                    return self._remove([r.uid], return_prompt_caches=True).get(r.uid)
                return r.prompt_cache, r.all_tokens

            self._deliver(request, r.token, r.logprobs, r.finish_reason, state)

    def _prefilling(self) -> list[Request]:
        """The admitted requests whose prompts are still being prefilled."""
        return [r for r in self.active.values() if r.prefilling]

    def _sided(self) -> bool:
        return any(uid >= SIDE_UIDS for uid in self.active)

    def _last_chunk(self, chunk: int) -> Request | None:
        """The prompt whose prefill ends with this step, if it is the only one prefilling
        and no request waits for a prefix boundary still ahead in it.

        It is taken out of the batch and finished alone (`_finish_prefill`): its first
        token comes from its last chunk's logits, not from a one-token step after it, and
        reaches the client before it joins a decode batch (`_place`); the join could copy a
        whole batch's KV (bench/README.md, "Running streams beside a long prefill").
        """
        prefilling = self._prefilling()
        if len(prefilling) != 1:
            return None
        (request,) = prefilling
        done = len(request.tokens) - request.left
        if request.left > chunk or (request.followers and request.boundary > done):
            return None
        return request

    def _take_out(self, request: Request) -> State:
        """`request`'s KV and tokens, taken out of the batch. The cache is `as_fresh`: it joins
        a batch again without a copy, and, the only holder of its buffers now, takes the
        rest of the prompt in its buffers' free slots in place."""
        cache, tokens = self.gen.remove([request.uid], return_prompt_caches=True)[request.uid]
        return as_fresh(cache), tokens

    def _finish_prefill(
        self, request: Request, cache: list[Any], tokens: list[int]
    ) -> float | None:
        """Prefill the rest of `request`'s prompt after the KV `cache` holds for `tokens`,
        then let it decode (`_start_alone`); the seconds its prefill took, None if it failed."""
        del self.active[request.uid]
        request.prefilling, request.left = False, 0
        try:
            sampler, processors = request.sampling()
            seconds = self._start_alone(request, cache, len(tokens), sampler, processors)
        except Exception:
            log.exception("finishing a prompt's prefill failed")
            self._fail_start(request)
            return None
        self._release(request)  # those waiting for its prefix: it is cached now
        return seconds

    def chunk(self, joining: int = 0, budget: bool = False, depth: int = 0) -> int:
        """Prompt tokens each prompt may prefill in the next step (with `joining` more about
        to join them, `depth` tokens into their prompts): within the decode gap while
        streams decode (`chunking`), the largest chunk when none does. `budget`: what all
        the step's prompts share."""
        e = self.engine
        decoding = any(not r.prefilling for r in self.active.values())
        prefilling = self._prefilling()
        prompts = 1 if budget else min(self.gen.prefill_batch_size, joining + len(prefilling))
        depth = max([depth, *(len(r.tokens) - r.left for r in prefilling)])
        return chunk_size(
            self.costs, decoding, e.decode_gap, e.min_prefill_chunk, e.prefill_step_size,
            prompts, depth,
        )  # fmt: skip

    def _prefill_depth(self, chunk: int) -> float:
        """Where the tokens the next step prefills stand in their prompts, as their cost is
        measured at: mlx-lm pads the prompts of a step to the deepest one, so every token
        costs about what the deepest prompt's do. A prompt's last token is left out: the
        batch runs it as a decode step, `_last_chunk` with the rest of the prompt."""
        prefilling = [r for r in self._prefilling() if r.left > 1]
        taken = [(len(r.tokens) - r.left, min(r.left - 1, chunk)) for r in prefilling]
        taken = taken[: self.gen.prefill_batch_size]
        if not taken:
            return 0.0
        return max(at for at, _ in taken) + max(n for _, n in taken) / 2

    def _on_prefill(self, progress: Any) -> None:
        request = self.active.get(progress.uid)
        if request is None:
            return
        if not request.prefilling:
            # Prefilled alone (`_start_alone`) and cached then: this is its first token
            # entering the batch. Storing it again would only copy the same KV, and reading
            # it from the batch would make this step evaluate the batch's join.
            return
        done, total = progress.progress
        request.left = total - done
        if progress.end_of_prompt:
            request.prefilling = False
        # Cached once prefilled, not only when it ends: a request that shares the prompt
        # and arrives while this one decodes starts from it.
        cached = self.engine.cache is not None
        awaited = (cached and progress.end_of_prompt) or (
            request.followers and progress.end_of_segment
        )
        # A hybrid model's prompt is cut into segments where it is to be checkpointed.
        checkpoint = cached and progress.end_of_segment and bool(request.params.checkpoints)
        # Beside running streams its KV goes into the cache chunk by chunk too, each step
        # copying its own chunk's: the whole prompt's copy, taken at its first token, fell
        # into one step the streams waited for (bench/README.md, "One forward pass for a
        # chunk and the streams' step").
        chunked = cached and not request.params.checkpoints and self._beside_streams(request)
        if awaited or checkpoint or chunked:
            self._store(request, self.gen.extract_cache([progress.uid]).get(progress.uid))
        if awaited:
            self._release(request)

    def _beside_streams(self, request: Request) -> bool:
        """`request` is the one prompt being prefilled, and streams are decoding."""
        prefilling = self._prefilling()
        return len(prefilling) == 1 and prefilling[0] is request and len(self.active) > 1

    def _deliver(self, request: Request, token: int, logprobs: mx.array, finish, state) -> bool:
        if not deliver(self.engine, request, token, logprobs, finish, state):
            return False
        self.active.pop(request.uid, None)
        return True

    def _store(self, request: Request, state: State | None) -> None:
        store(self.engine, request, state)

    # ----------------------------------------------------------------- exits

    def drop_cancelled(self) -> None:
        for request, _ in self.queue:
            if request.cancelled:
                request.end(Finished("cancelled", 0))
        self.queue = [(r, t) for r, t in self.queue if not r.cancelled]
        gone = [uid for uid, request in self.active.items() if request.cancelled]
        if not gone:
            return
        caches = self._remove(gone, return_prompt_caches=True)
        for uid in gone:
            self._store(self.active[uid], caches.get(uid))
            request = self.active.pop(uid)
            request.end(Finished("cancelled", request.generated))
            self.engine.stats.cancelled += 1
            self._release(request)

    def _drop_faulted(self) -> None:
        """Take requests whose own sampler or processors raised out of the batch; fail them."""
        faulted = [uid for uid, request in self.active.items() if request.fault is not None]
        if faulted:
            self._remove(faulted)
            for uid in faulted:
                self._fail_faulted(self.active.pop(uid))

    def _fail_faulted(self, request: Request) -> None:
        log.error("a request's sampling failed: %r", request.fault)
        followers, request.followers = request.followers, []
        request.end(Failed("Sampling failed for this request's parameters."))
        self.engine.stats.failed += 1
        for follower in followers:  # they wait for a prefix, not for this request's output
            self.engine.requeue(follower)


def deliver(
    engine: Host,
    request: Request,
    token: int,
    logprobs: mx.array,
    finish: str | None,
    state: Callable[[], State | None],
) -> bool:
    """Send one generated token on; when it ends the request, cache its KV and say so."""
    delta, reason = next_output(request, engine.tokenizer, token, logprobs, finish)
    if reason is None:
        if delta.text or delta.logprobs:
            request.emit(delta)
        return False
    # The client hears the end first; the cache insert follows on this same thread,
    # so no later request can be admitted before it is done.
    kv = state()
    if delta.text or delta.logprobs:
        request.emit(delta)
    request.end(Finished(reason, request.generated, request.stops.matched))
    engine.stats.finished += 1
    store(engine, request, kv)
    return True


def store(engine: Host, request: Request, state: State | None) -> None:
    """Put a sequence's KV into the cache, for the next turn or for waiting requests."""
    cache = engine.cache
    if cache is None or state is None or not state[0] or not state[1]:
        return
    kv, tokens = state
    try:
        cache.insert(request.cache_key, request.state_key(tokens), kv)
    except ValueError as e:  # never worth failing a request over
        log.warning("not caching a sequence of %d tokens: %s", len(tokens), e)
