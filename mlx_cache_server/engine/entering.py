"""How requests enter the batch: the queue, which of its requests start now
(`schedule.choose`), which wait for a prefix being prefilled (`admission`), and
admitting the rest, a failure at admission ending that request only.

`Entering` is the batch's entering policy: it owns the queue and decides who starts;
starting one is the batch's (`start`, handed in). Runs on the engine thread alone.

Invariants: `queue` holds the requests taken and not yet admitted, with when they came;
a request that leaves it has been ended (`Request.end`), admitted, or made a follower
of a prompt being prefilled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .admission import plan_admission
from .chunking import StepCosts
from .events import Finished
from .request import Request
from .schedule import Waiting, choose, join_limit

if TYPE_CHECKING:
    from mlx_cache_server.prompt_cache import PromptCache

    from .running import Running
    from .wiring import Fail, Requeue

log = logging.getLogger("mlx_cache_server.engine")


class Entering:
    def __init__(
        self,
        running: Running,
        cache: PromptCache | None,
        costs: StepCosts,
        *,
        max_prefill_wait: float,
        min_shared_prefix: int,
        start: Callable[[Request, bool], bool],
        budget: Callable[[], int],
        fail: Fail,
        requeue: Requeue,
    ) -> None:
        """`start(request, alone)`: the batch's start of an admitted request, True when its
        prompt now prefills in the batch; `budget()`: the prompt tokens the next step's
        prompts share; `fail`, `requeue`: the engine thread's."""
        self.running = running
        self.cache = cache
        self.costs = costs  # the batch's: what its steps measured
        self.max_prefill_wait = max_prefill_wait
        self.min_shared_prefix = min_shared_prefix
        self._start, self._budget = start, budget
        self._fail, self._requeue = fail, requeue
        self.queue: list[tuple[Request, float]] = []
        self._replan = False  # new in the queue or newly prefilling: look for shared prefixes

    def intake(self, new: list[Request], now: float) -> None:
        self.queue += [(request, now) for request in new]
        self._replan = True
        self.start_queued(now)

    def start_queued(self, now: float) -> None:
        """Admit the queued requests `schedule.choose` starts now; with nothing left
        running, more until something runs or nothing waits."""
        while self.queue:
            self._follow_prefilling()
            prefilling = [r.left for r in self.running.prefilling()]
            line = [Waiting(r, self._uncached(r), t) for r, t in self.queue]
            limit = join_limit(*self._step_and_token_costs())
            chosen = choose(line, prefilling, self._budget(), now, self.max_prefill_wait, limit)
            if not chosen:
                return
            self.queue = [(r, t) for r, t in self.queue if all(r is not c for c in chosen)]
            try:
                self._plan(chosen)
            except Exception:  # out of the queue and maybe not admitted: answer them here
                self._fail(chosen, "Generation failed on the server. Retry.")
                raise
            if self.running.active:
                return

    def drop_cancelled(self) -> None:
        """End the queued requests whose clients gave up."""
        for request, _ in self.queue:
            if request.cancelled:
                request.end(Finished("cancelled", 0))
        self.queue = [(r, t) for r, t in self.queue if not r.cancelled]

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
        cache, leaders = self.cache, self.running.prefilling()
        if cache is None or not leaders or not self._replan:
            return
        self._replan = False
        plan = plan_admission(
            [r for r, _ in self.queue],
            leaders,
            cached=self._held,
            min_shared=self.min_shared_prefix,
        )
        following = [r for r, leader in plan.leader_of.items() if any(leader is x for x in leaders)]
        for request in following:
            plan.leader_of[request].followers.append(request)
        self.queue = [(r, t) for r, t in self.queue if all(r is not f for f in following)]

    def _uncached(self, request: Request) -> int:
        return len(request.tokens) - self._held(request)

    def _held(self, request: Request) -> int:
        """Tokens of the request's prompt the cache holds now."""
        cache = self.cache
        return cache.peek(request.cache_key, request.packed)[1] if cache is not None else 0

    def _plan(self, new: list[Request]) -> None:
        if self.cache is None:
            for request in new:
                self._admit(request, alone=len(new) == 1)
            return
        prefilling = self.running.prefilling()
        plan = plan_admission(
            new,
            prefilling,
            cached=self._held,
            min_shared=self.min_shared_prefix,
        )
        for follower, leader in plan.leader_of.items():
            leader.followers.append(follower)
        for leader, boundary in plan.boundary.items():
            leader.boundary = boundary
        for request in plan.admit:
            self._admit(request, alone=len(plan.admit) == 1)

    def _admit(self, request: Request, alone: bool) -> None:
        try:
            if self._start(request, alone):  # newly prefilling: look for shared prefixes
                self._replan = True
        except Exception:
            log.exception("admitting a request failed")
            self.fail_start(request)

    def fail_start(self, request: Request) -> None:
        """Fail a request whose start (its admission, its last chunk) raised; the batch runs
        on (sharded: on every rank alike, or the next step's handover finds the ranks apart:
        `step_digest`)."""
        active = self.running.active
        if active.pop(request.uid, None) is not None:  # in the batch already
            self.running.remove([request.uid])
        followers, request.followers = request.followers, []
        self._fail([request], "Generation failed on the server. Retry.")
        for follower in followers:  # other users' requests: they wait for a prefix only
            self._requeue(follower)

    def release(self, leader: Request) -> None:
        """Admit those waiting for `leader`'s prefix: it is cached, or will never be."""
        followers, leader.followers = leader.followers, []
        for request in followers:
            self._admit(request, alone=len(followers) == 1)
