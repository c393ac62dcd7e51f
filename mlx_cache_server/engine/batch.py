"""The running batch: admission into mlx-lm's `BatchGenerator`, its steps, and exits.

`Batch` starts admitted requests and runs the steps; it has the admitted requests and
their generators (`running.Running`), a costs record (`chunking.StepCosts`), and three
parts, each handed what it uses: how requests enter (`entering.Entering`), how a
prompt's prefill runs and is cached (`prompts.PromptSteps`), and how requests leave
(`exits.Exits`). It is made by the engine thread from what the engine hands it
(`wiring`), and owned by that thread alone.

A request enters through `intake` and waits in the entering policy's queue until
`schedule.choose` starts it (shortest prompt first, with a bounded wait); admitted
(planned by `admission.plan_admission`), it is prefilled on its own
(`prefill.prefill_alone`) or with others by the generator in chunks (the last one on
its own again when it is the only prompt left: `PromptSteps.last_chunk`), yields one
token per step (`output`), and leaves finished, stopped, cancelled or failed; its KV
goes into the prompt cache on the way out, and a shared prefix as soon as it is
prefilled. A sequence prefilled on its own decodes in a second generator, the side
batch, when joining the main one would pad it mostly with nothing (`placement`).

Invariants: those of `Running` (`active`) and `Entering` (`queue`); a request that
leaves `active` or `queue` has been ended (`Request.end`) or admitted; a failure that
belongs to one request (its sampling, its admission) ends that request only.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from mlx_cache_server.prompt_cache import fresh_cache

from .chunking import StepCosts, chunk_size
from .entering import Entering
from .events import Finished, Started
from .exits import Exits, State
from .positions import PLAIN
from .prompts import PromptSteps
from .request import Request, with_followers
from .running import Running
from .steps import Measured
from .text import StopMatcher

if TYPE_CHECKING:
    from .wiring import BatchSettings, Fail, Outlet, Requeue

log = logging.getLogger("mlx_cache_server.engine")


class Batch:
    def __init__(
        self,
        model: Any,
        outlet: Outlet,
        settings: BatchSettings,
        fail: Fail,
        requeue: Requeue,
    ) -> None:
        """`fail`, `requeue`: the engine thread's, for requests that fail or wait again."""
        self.model = model
        self.outlet = outlet
        self.settings = settings
        self.running = Running(
            model, settings.generator, settings.completion_batch_size,
            on_verified=self._verified, recent_for=self._recent_replies,
        )  # fmt: skip
        self.costs = StepCosts()  # what the steps measured (on rank 0, when sharded)
        self.cost: Measured | None = None  # the last step's, for the next step's inputs
        self.now = 0.0  # the step's time, from its inputs: the same on every rank
        self.entering = Entering(
            self.running, outlet.cache, self.costs,
            max_prefill_wait=settings.max_prefill_wait,
            min_shared_prefix=settings.min_shared_prefix,
            start=self._start, budget=functools.partial(self.chunk, budget=True),
            fail=fail, requeue=requeue,
        )  # fmt: skip
        self.exits = Exits(self.running, outlet, requeue, release=self.entering.release)
        self.prompts = PromptSteps(
            self.running, model, outlet.tokenizer.eos_token_ids,
            prefill_step_size=settings.prefill_step_size, cached=outlet.cache is not None,
            exits=self.exits, release=self.entering.release, fail_start=self.entering.fail_start,
            positions=settings.generator.get("positions", PLAIN),
        )  # fmt: skip

    def close(self) -> None:
        self.running.close()

    @property
    def active(self) -> dict[int, Request]:
        """The admitted requests, by their generator's uid."""
        return self.running.active

    @property
    def queue(self) -> list[tuple[Request, float]]:
        """The requests taken and not yet admitted, with when they came."""
        return self.entering.queue

    @property
    def busy(self) -> bool:
        return bool(self.active or self.queue)

    def everyone(self) -> list[Request]:
        return with_followers([*self.active.values(), *(r for r, _ in self.queue)])

    def intake(self, new: list[Request]) -> None:
        self.entering.intake(new, self.now)

    def drop_cancelled(self) -> None:
        self.entering.drop_cancelled()
        self.exits.drop_cancelled()

    # -------------------------------------------------------------- entering

    def _start(self, request: Request, alone: bool) -> bool:
        """Start an admitted request: fetch what the cache holds of its prompt, then prefill
        the rest alone (and let it decode), or in the generator beside other prompts;
        True in the second case, when its prompt is now being prefilled in the batch."""
        outlet = self.outlet
        if request.cancelled:
            request.end(Finished("cancelled", 0))
            self.entering.release(request)
            return False
        tokens, p = request.tokens, request.params
        cached, n = None, 0
        if outlet.cache is not None:
            found = outlet.cache.fetch(request.cache_key, request.packed)
            cached, n = found.cache, found.n_cached
        request.detok = outlet.tokenizer.detokenizer
        request.stops = StopMatcher(p.stop)
        sampler, processors = request.sampling()
        outlet.stats.admitted += 1
        request.emit(Started(prompt_tokens=len(tokens), cached_tokens=n))
        # Prefilling here holds up the batch's decoding until done: for one step's
        # worth of tokens that is what BatchGenerator does too. A longer prompt goes in
        # chunks, so that shorter ones arriving meanwhile can start beside it.
        short = len(tokens) - n <= self.chunk(joining=1, depth=n)
        if alone and not request.followers and short:
            fresh = cached or fresh_cache(self.model)
            self.prompts.start_alone(request, fresh, n, sampler, processors)
            return False
        cuts = segment_cuts(n, len(tokens), request.boundary, request.params.checkpoints)
        segments = [tokens[a:b] for a, b in zip([n, *cuts], [*cuts, len(tokens)], strict=True)]
        (request.uid,) = self.running.gen.insert_segments(
            [segments],
            max_tokens=[p.max_tokens],
            # Nothing cached: a fresh cache all the same, so the batch hands the prompt out
            # as views with room to go on in place (`PromptSteps.take_out`), not a cut copy.
            caches=[cached or fresh_cache(self.model)],
            all_tokens=[tokens[:n]],
            samplers=[sampler],
            logits_processors=[processors],
        )
        request.prefilling = True
        request.left = len(tokens) - n
        self.active[request.uid] = request
        return True

    # ----------------------------------------------------------------- steps

    def step(self) -> None:
        """One prefill or decode step of the batch (and a decode step of the side batch),
        its results handled.

        A method of its own so the step's responses die with it: a finished
        sequence's response holds its whole KV, which, left in a loop variable,
        would stay alive while the next request's own KV is fetched and prefilled.
        """
        self.cost = None
        self.entering.start_queued(self.now)
        if not self.active:
            return
        running, prompts = self.running, self.prompts
        running.gen.prefill_step_size = chunk = self.chunk()
        depth = prompts.prefill_depth(chunk)
        last = prompts.last_chunk(chunk)
        taken = prompts.take_out(last) if last else None
        with running.gen.stats() as stats:  # mlx-lm's own counters, over this step
            prefills, responses = running.gen.next()
        self._handle(prefills, responses)
        seconds, prompt_tokens = stats.wall_time, stats.prompt_tokens
        decoded = stats.generation_steps > 0
        if running.sided():  # after the main batch's tokens are out: they need not wait for it
            with running.side.stats() as side:
                side_prefills, side_responses = running.side.next()
            self._handle(side_prefills, side_responses)
            seconds, decoded = seconds + side.wall_time, decoded or side.generation_steps > 0
        if last is not None:  # after the streams' tokens are out: they need not wait for it
            left, took = last.left, prompts.finish_prefill(last, *taken)
            if took is not None:  # not failed: a measurement
                seconds, prompt_tokens = seconds + took, prompt_tokens + left
        self.cost = Measured(seconds, prompt_tokens, decoded, depth)
        self.exits.drop_faulted()

    def _handle(self, prefills: list[Any], responses: list[Any]) -> None:
        """A generator's step's results: prompts' progress, then each sequence's token."""
        for progress in prefills:
            self.prompts.on_prefill(progress)
        # A verified draft can end in mlx-lm's batch (its limit, an end token) at a later
        # token than a stop string ends it here: the KV comes with that later response.
        ended = {r.uid: r for r in responses if r.finish_reason is not None}
        for r in responses:
            request = self.active.get(r.uid)
            if request is None:  # ended at an earlier token of a verified draft (a stop string)
                continue
            if request.fault is not None:
                if r.finish_reason is not None:  # out of the batch already
                    self.exits.fail_faulted(self.active.pop(r.uid))
                continue

            def state(r: Any = r) -> State | None:
                if r.finish_reason is None and r.uid in ended:  # out of the batch already
                    r = ended[r.uid]
                elif r.finish_reason is None:  # stopped by a stop string: take it out
                    return self.running.remove([r.uid], return_prompt_caches=True).get(r.uid)
                return r.prompt_cache, r.all_tokens

            self.exits.deliver(request, r.token, r.logprobs, r.finish_reason, state)

    def _verified(self, uid: int, drafted: int, accepted: int) -> None:
        request = self.active.get(uid)
        if request is not None:
            request.drafted += drafted
            request.accepted += accepted
        stats = self.outlet.stats
        stats.drafted += drafted
        stats.accepted += accepted
        stats.drafts += 1

    def _recent_replies(self, uid: int) -> list[Any]:
        request = self.active.get(uid)
        return [] if request is None else self.outlet.replies.latest(request.cache_key)

    def chunk(self, joining: int = 0, budget: bool = False, depth: int = 0) -> int:
        """Prompt tokens each prompt may prefill in the next step (with `joining` more about
        to join them, `depth` tokens into their prompts): within the decode gap while
        streams decode (`chunking`), the largest chunk when none does. `budget`: what all
        the step's prompts share."""
        s, running = self.settings, self.running
        decoding = running.decoding()
        prefilling = running.prefilling()
        prompts = 1 if budget else min(running.gen.prefill_batch_size, joining + len(prefilling))
        depth = max([depth, *(len(r.tokens) - r.left for r in prefilling)])
        return chunk_size(
            self.costs, decoding, s.decode_gap, s.min_prefill_chunk, s.prefill_step_size,
            prompts, depth,
        )  # fmt: skip


def segment_cuts(n: int, end: int, boundary: int, checkpoints: tuple[int, ...]) -> list[int]:
    """Where a prompt prefilled from `n` to `end` is cut into segments: at the prefix others
    wait for, and at checkpoints that leave no segment of one token (a step of one-token
    prompts updates sliding windows in place, which mlx-lm's next chunk does not expect)."""
    cuts = {boundary} if n < boundary < end else set()
    for p in sorted(checkpoints):
        if n + 2 <= p < end and all(abs(p - c) >= 2 for c in cuts):
            cuts.add(p)
    return sorted(cuts)
