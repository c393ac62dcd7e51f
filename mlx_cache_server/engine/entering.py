"""How requests enter the batch: the queue, which of its requests start now
(`schedule.choose`), which wait for a prefix being prefilled (`admission`), and
admitting the rest, a failure at admission ending that request only.

`Entering` is a part of `Batch` (its methods run on the batch's state, and call its
`_start`, `_remove` and `chunk`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .admission import plan_admission
from .chunking import StepCosts
from .request import Request
from .schedule import Waiting, choose, join_limit

if TYPE_CHECKING:
    from .host import Host

log = logging.getLogger("mlx_cache_server.engine")


class Entering:
    engine: Host
    queue: list[tuple[Request, float]]
    active: dict[int, Request]
    costs: StepCosts
    now: float
    _replan: bool

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

    def _release(self, leader: Request) -> None:
        """Admit those waiting for `leader`'s prefix: it is cached, or will never be."""
        followers, leader.followers = leader.followers, []
        for request in followers:
            self._admit(request, alone=len(followers) == 1)
