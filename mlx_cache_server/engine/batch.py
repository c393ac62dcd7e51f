"""The running batch: admission into mlx-lm's `BatchGenerator`, its steps, and exits.

`Batch` is this module's starting of admitted requests and its steps, with three
parts of its own: how requests enter (`entering.Entering`), how a prompt's prefill
runs and is cached (`prompts.PromptSteps`), and how requests leave (`exits.Exits`).

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
from typing import TYPE_CHECKING, Any

from mlx_cache_server.prompt_cache import fresh_cache

from .chunking import StepCosts, chunk_size
from .entering import Entering
from .events import Finished, Started
from .exits import Exits, State
from .generator import MixedGenerator
from .placement import place
from .prompts import PromptSteps
from .request import Request, with_followers
from .steps import Measured
from .text import StopMatcher

if TYPE_CHECKING:
    from .host import Host

log = logging.getLogger("mlx_cache_server.engine")

SIDE_UIDS = 1 << 48  # the side batch numbers its sequences from here: one `active` for both


class Batch(Entering, PromptSteps, Exits):
    def __init__(self, engine: Host) -> None:
        self.engine = engine
        self.gen = MixedGenerator(engine.model, **engine.batch_args)
        self.side = MixedGenerator(engine.model, **engine.batch_args)
        self.gen.on_verified = self.side.on_verified = self._verified
        self.gen.recent_for = self.side.recent_for = self._recent_replies
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
        cuts = segment_cuts(n, len(tokens), request.boundary, request.params.checkpoints)
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
        # A verified draft can end in mlx-lm's batch (its limit, an end token) at a later
        # token than a stop string ends it here: the KV comes with that later response.
        ended = {r.uid: r for r in responses if r.finish_reason is not None}
        for r in responses:
            request = self.active.get(r.uid)
            if request is None:  # ended at an earlier token of a verified draft (a stop string)
                continue
            if request.fault is not None:
                if r.finish_reason is not None:  # out of the batch already
                    self._fail_faulted(self.active.pop(r.uid))
                continue

            def state(r: Any = r) -> State | None:
                if r.finish_reason is None and r.uid in ended:  # out of the batch already
                    r = ended[r.uid]
                elif r.finish_reason is None:  # stopped by a stop string: take it out
                    return self._remove([r.uid], return_prompt_caches=True).get(r.uid)
                return r.prompt_cache, r.all_tokens

            self._deliver(request, r.token, r.logprobs, r.finish_reason, state)

    def _verified(self, uid: int, drafted: int, accepted: int) -> None:
        request = self.active.get(uid)
        if request is not None:
            request.drafted += drafted
            request.accepted += accepted
        self.engine.stats.drafted += drafted
        self.engine.stats.accepted += accepted
        self.engine.stats.drafts += 1

    def _recent_replies(self, uid: int) -> list[Any]:
        request = self.active.get(uid)
        return [] if request is None else self.engine.replies.latest(request.cache_key)

    def _prefilling(self) -> list[Request]:
        """The admitted requests whose prompts are still being prefilled."""
        return [r for r in self.active.values() if r.prefilling]

    def _sided(self) -> bool:
        return any(uid >= SIDE_UIDS for uid in self.active)

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

    # ----------------------------------------------------------------- exits


def segment_cuts(n: int, end: int, boundary: int, checkpoints: tuple[int, ...]) -> list[int]:
    """Where a prompt prefilled from `n` to `end` is cut into segments: at the prefix others
    wait for, and at checkpoints that leave no segment of one token (a step of one-token
    prompts updates sliding windows in place, which mlx-lm's next chunk does not expect)."""
    cuts = {boundary} if n < boundary < end else set()
    for p in sorted(checkpoints):
        if n + 2 <= p < end and all(abs(p - c) >= 2 for c in cuts):
            cuts.add(p)
    return sorted(cuts)
