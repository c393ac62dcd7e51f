"""A request as the engine thread sees it, and what it supplies to the batch, guarded."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from mlx_cache_server.prompt_cache import PackedTokens

from .events import Failed, Finished, SamplingParams
from .sampling import make_processors, make_sampler
from .text import StopMatcher

_rids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation. `cancel()` is safe from any thread; the rest is the engine thread's,
    which sets `cancelled` when a step's inputs say so (`steps`).

    Invariant: `end` sends the request's last event exactly once, whatever fails
    around it, so no client waits for an event that never comes.
    """

    tokens: list[int]
    params: SamplingParams
    emit: Callable[[Any], None]
    cache_key: Any = None  # the prompt-cache model key: this model, in this tenant's namespace
    packed: PackedTokens = field(init=False)  # `tokens`, packed once for every lookup and insert
    rid: int = field(default_factory=lambda: next(_rids))  # the same on every rank
    cancel_asked: bool = False  # by the client, from any thread
    cancelled: bool = False  # as the engine's steps see it
    uid: int = -1
    generated: int = 0
    drafted: int = 0  # draft tokens verified for it, and accepted (`speculative`)
    accepted: int = 0
    detok: Any = None
    stops: StopMatcher | None = None
    prefilling: bool = False
    left: int = 0  # while prefilling: prompt tokens not yet run
    boundary: int = 0  # tokens of a prefix shared with waiting requests, cached once prefilled
    followers: list[Request] = field(default_factory=list)  # waiting for that prefix
    fault: Exception | None = None  # raised by this request's own sampler or processors
    ended: bool = False  # its last event (Finished or Failed) was sent

    def __post_init__(self) -> None:
        self.packed = PackedTokens.of(self.tokens)

    def cancel(self) -> None:
        self.cancel_asked = True

    def end(self, event: Finished | Failed) -> None:
        if not self.ended:
            self.ended = True
            self.emit(event)

    def sampling(self) -> tuple[Callable, list[Callable]]:
        """This request's sampler and logits processors, each guarded (see `guarded`)."""
        p = self.params
        sampler = make_sampler(p.temperature, p.top_p, p.top_k, p.min_p, p.seed)
        if sampler is not greedy_sampler:  # one shared argmax lets the batch sample in one call
            sampler = guarded(self, sampler, greedy_sampler)
        processors = make_processors(p.logit_bias, p.presence_penalty, p.frequency_penalty)
        if p.constraint is not None:
            # Last: penalties and biases first, then what the grammar forbids is -inf.
            processors = [*processors, p.constraint]
        return sampler, [guarded(self, fn, _unchanged) for fn in processors]

    def state_key(self, tokens: list[int]) -> PackedTokens | list[int]:
        """A state's tokens for the cache: the prompt was packed on arrival.

        A request's state holds a prefix of its prompt (a shared prefix cached
        early) or the prompt and what was generated after it; only the generated
        part is packed here. The check costs a list compare, far less than packing.
        """
        prompt, n = self.tokens, len(self.tokens)
        if len(tokens) <= n:
            if tokens == prompt[: len(tokens)]:
                return self.packed.prefix(len(tokens))
        elif tokens[:n] == prompt:
            return self.packed.extend(tokens[n:])
        return list(tokens)  # not this request's sequence after all: pack it whole


def guarded(request: Request, fn: Callable, fallback: Callable) -> Callable:
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

    call.__wrapped__ = fn  # a `Categorical`'s key, for a step that rewinds it
    return call


def _unchanged(_: mx.array, logits: mx.array) -> mx.array:
    return logits


def with_followers(requests: list[Request]) -> list[Request]:
    """These requests and, after each, those waiting on it, recursively."""
    out = []
    for request in requests:
        out += [request, *with_followers(request.followers)]
    return out
