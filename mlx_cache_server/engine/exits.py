"""How requests leave the batch: a finished one's last token sent and its KV cached, a
cancelled one ended with what it generated, a failed one with its error.

`Exits` is the batch's exit handler: it acts on the batch's `Running` and sends output to
the `Outlet` it is handed. `deliver` and `store` serve the quantized-KV runner too. Runs
on the engine thread alone.
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

    from .running import Running
    from .wiring import Outlet, Requeue

log = logging.getLogger("mlx_cache_server.engine")

State = tuple[list[Any], list[int]]  # a sequence's KV cache and its tokens


class Exits:
    def __init__(
        self,
        running: Running,
        outlet: Outlet,
        requeue: Requeue,
        release: Callable[[Request], None],
    ) -> None:
        """`requeue`: the engine thread's, for those waiting on a failed request's prefix;
        `release`: admits those waiting on a request's prefix (`Entering.release`)."""
        self.running = running
        self.outlet = outlet
        self._requeue = requeue
        self._release = release

    def deliver(self, request: Request, token: int, logprobs: mx.array, finish, state) -> bool:
        """`deliver`, and out of `active` once it ends the request."""
        if not deliver(self.outlet, request, token, logprobs, finish, state):
            return False
        self.running.active.pop(request.uid, None)
        return True

    def store(self, request: Request, state: State | None) -> None:
        store(self.outlet, request, state)

    def drop_cancelled(self) -> None:
        """End the admitted requests whose clients gave up; their KV is cached."""
        active = self.running.active
        gone = [uid for uid, request in active.items() if request.cancelled]
        if not gone:
            return
        caches = self.running.remove(gone, return_prompt_caches=True)
        for uid in gone:
            self.store(active[uid], caches.get(uid))
            request = active.pop(uid)
            request.end(Finished("cancelled", request.generated, None, request.drafted,
                                 request.accepted))  # fmt: skip
            self.outlet.stats.cancelled += 1
            self._release(request)

    def drop_faulted(self) -> None:
        """Take requests whose own sampler or processors raised out of the batch; fail them."""
        active = self.running.active
        faulted = [uid for uid, request in active.items() if request.fault is not None]
        if faulted:
            self.running.remove(faulted)
            for uid in faulted:
                self.fail_faulted(active.pop(uid))

    def fail_faulted(self, request: Request) -> None:
        log_fault(request.fault)
        followers, request.followers = request.followers, []
        request.end(sampling_failed(request.fault))
        self.outlet.stats.failed += 1
        for follower in followers:  # they wait for a prefix, not for this request's output
            self._requeue(follower)


def deliver(
    outlet: Outlet,
    request: Request,
    token: int,
    logprobs: mx.array,
    finish: str | None,
    state: Callable[[], State | None],
) -> bool:
    """Send one generated token on; when it ends the request, cache its KV and say so."""
    delta, reason = next_output(request, outlet.tokenizer, token, logprobs, finish)
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
    outlet.stats.finished += 1
    store(outlet, request, kv)
    return True


def store(outlet: Outlet, request: Request, state: State | None) -> None:
    """Put a sequence's KV into the cache, for the next turn or for waiting requests, and
    its reply among the replies drafts are made from."""
    cache = outlet.cache
    if cache is None or state is None or not state[0] or not state[1]:
        return
    kv, tokens = state
    outlet.replies.add(request.cache_key, tokens, len(request.tokens))
    try:
        cache.insert(request.cache_key, request.state_key(tokens), kv)
    except ValueError as e:  # never worth failing a request over
        log.warning("not caching a sequence of %d tokens: %s", len(tokens), e)
