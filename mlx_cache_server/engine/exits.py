"""How requests leave the batch: a finished one's last token sent and its KV cached, a
cancelled one ended with what it generated, a failed one with its error.

`Exits` is a part of `Batch` (its methods run on the batch's `engine`, `queue` and
`active`, and its `_remove`); `deliver` and `store` serve the solo runner too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .events import Finished, log_fault, sampling_failed
from .output import next_output
from .request import Request

if TYPE_CHECKING:
    from collections.abc import Callable

    from .host import Host

log = logging.getLogger("mlx_cache_server.engine")

State = tuple[list[Any], list[int]]  # a sequence's KV cache and its tokens


class Exits:
    engine: Host
    queue: list[tuple[Request, float]]
    active: dict[int, Request]

    def _deliver(self, request: Request, token: int, logprobs: mx.array, finish, state) -> bool:
        if not deliver(self.engine, request, token, logprobs, finish, state):
            return False
        self.active.pop(request.uid, None)
        return True

    def _store(self, request: Request, state: State | None) -> None:
        store(self.engine, request, state)

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
            request.end(Finished("cancelled", request.generated, None, request.drafted,
                                 request.accepted))  # fmt: skip
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
        log_fault(request.fault)
        followers, request.followers = request.followers, []
        request.end(sampling_failed(request.fault))
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
    request.end(Finished(reason, request.generated, request.stops.matched, request.drafted,
                         request.accepted))  # fmt: skip
    engine.stats.finished += 1
    store(engine, request, kv)
    return True


def store(engine: Host, request: Request, state: State | None) -> None:
    """Put a sequence's KV into the cache, for the next turn or for waiting requests, and
    its reply among the replies drafts are made from."""
    cache = engine.cache
    if cache is None or state is None or not state[0] or not state[1]:
        return
    kv, tokens = state
    engine.replies.add(request.cache_key, tokens, len(request.tokens))
    try:
        cache.insert(request.cache_key, request.state_key(tokens), kv)
    except ValueError as e:  # never worth failing a request over
        log.warning("not caching a sequence of %d tokens: %s", len(tokens), e)
