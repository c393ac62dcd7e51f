"""The steps of a model sharded over several processes (`mlx.launch`): rank 0 decides, all run.

Every rank holds a shard of the model (some heads of every layer, or some layers) and
its own prompt cache, holding the KV of its shard. A forward pass is collective, so
every rank must run the same steps on the same sequences, and each rank's cache must
match, keep and evict exactly as the others do. Rank 0, which serves HTTP, reads each
step's inputs (`steps.LocalSteps`) and hands them to the others with `mx.distributed`
before running it (`LeaderSteps`); the others run what they are handed
(`FollowerSteps`). What the batch and the cache then decide follows from the inputs
alone: chunk sizes from the costs rank 0 measured, admission order from rank 0's clock,
sampling from a seed rank 0 chose for each request, cache bytes counted alike on
every rank (`rank_bytes`).

A step with nothing to hand over and nothing running is not sent: an idle server costs
the others nothing. Each handover also carries rank 0's cache counters as they stood
before the step; a follower whose own differ stops (`Diverged`) rather than run on a
cache that no longer matches.

Any failure of a step ends the engine on that rank (`Engine.sharded`); a rank whose
peer is gone sees its next collective fail within seconds (the ring backend's error),
so the server stops instead of hanging.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlx_cache_server.prompt_cache import PromptCache

from .constraint import GrammarTokenizer, build_constraint
from .events import EngineStats
from .request import Request
from .steps import LocalSteps, Measured, StepInputs


class Diverged(RuntimeError):
    """A follower's engine or prompt cache no longer matches rank 0's."""


def broadcast(group: mx.distributed.Group, obj: Any) -> Any:
    """`obj` from rank 0 on every rank (pass None on the others).

    On the stream the model's steps run on: a sharded forward pass makes collectives of
    its own, which mlx-lm evaluates asynchronously, and collectives of two streams could
    interleave on the wire in a different order on each rank.
    """
    s = generation_stream
    if group.rank() == 0:
        data = mx.array(pickle.dumps(obj))
        # One at a time: evaluated together, the two could run in either order.
        mx.eval(mx.distributed.all_sum(data.size, group=group, stream=s))
        mx.eval(mx.distributed.all_sum(data, group=group, stream=s))
        return obj
    size = mx.distributed.all_sum(0, group=group, stream=s).item()
    data = mx.distributed.all_sum(mx.zeros(size, mx.uint8), group=group, stream=s)
    return pickle.loads(data)


def step_digest(cache: PromptCache | None, stats: EngineStats | None) -> tuple[int, ...]:
    """What every rank must agree on after each step: its cache's counters, and how many
    requests it admitted and failed (a failure of one rank's own, say out of memory,
    parts it from the others; a request that fails alike on every rank does not)."""
    digest = (stats.admitted, stats.failed) if stats is not None else ()
    if cache is None:
        return digest
    s = cache.stats()
    return (*digest, len(cache), cache.nbytes, s.inserts, s.rejected, s.evictions,
            s.shortened, s.tokens_reused)  # fmt: skip


class LeaderSteps:
    """Rank 0: its own inputs, handed to every other rank before it runs them."""

    def __init__(
        self,
        local: LocalSteps,
        group: mx.distributed.Group,
        cache: PromptCache | None,
        stats: EngineStats | None = None,
    ) -> None:
        self.local, self.group, self.cache, self.stats = local, group, cache, stats
        self._seeds = random.SystemRandom()

    def next(self, busy: bool) -> StepInputs:
        inputs = self.local.next(busy)
        if inputs.empty and not busy:
            return inputs
        for request in inputs.new:
            if request.params.seed is None:  # one draw, the same on every rank
                request.params = replace(request.params, seed=self._seeds.getrandbits(63))
        broadcast(self.group, _handover(inputs, step_digest(self.cache, self.stats)))
        return inputs

    def measured(self, cost: Measured | None) -> None:
        self.local.measured(cost)


class FollowerSteps:
    """Any other rank: the inputs rank 0 hands over, its requests rebuilt here."""

    def __init__(
        self,
        group: mx.distributed.Group,
        cache: PromptCache | None,
        grammars: GrammarTokenizer,
        stats: EngineStats | None = None,
    ) -> None:
        self.group, self.cache, self.grammars, self.stats = group, cache, grammars, stats
        self._live: dict[int, Request] = {}

    def next(self, busy: bool) -> StepInputs:
        h = broadcast(self.group, None)
        own = step_digest(self.cache, self.stats)
        if h["digest"] != own:
            raise Diverged(f"this rank's engine and cache {own} no longer match rank 0's "
                           f"{h['digest']}")  # fmt: skip
        new = [self._request(*item) for item in h["new"]]
        self._live.update((r.rid, r) for r in new)
        cancelled = [self._live[rid] for rid in h["cancelled"] if rid in self._live]
        for rid in [rid for rid, r in self._live.items() if r.ended]:
            del self._live[rid]
        measured = Measured(*h["measured"]) if h["measured"] is not None else None
        return StepInputs(h["now"], new, cancelled, measured, h["flush"], h["release"], h["stop"])

    def measured(self, cost: Measured | None) -> None:
        pass  # rank 0's measurements size every rank's chunks

    def _request(self, rid: int, tokens: list[int], params: Any, grammar: str | None,
                 cache_key: Any) -> Request:  # fmt: skip
        if grammar is not None:
            params = replace(params, constraint=build_constraint(self.grammars, grammar))
        return Request(tokens, params, _nobody, cache_key, rid=rid)


def _handover(inputs: StepInputs, digest: tuple[int, ...]) -> dict[str, Any]:
    m = inputs.measured
    return {
        "now": inputs.now,
        "new": [_wire(r) for r in inputs.new],
        "cancelled": [r.rid for r in inputs.cancelled],
        "measured": (m.seconds, m.prompt_tokens, m.decoded, m.depth) if m is not None else None,
        "flush": inputs.flush,
        "release": inputs.release,
        "stop": inputs.stop,
        "digest": digest,
    }


def _wire(r: Request) -> tuple[int, list[int], Any, str | None, Any]:
    constraint = r.params.constraint
    grammar = getattr(constraint, "grammar", None)
    return r.rid, r.tokens, replace(r.params, constraint=None), grammar, r.cache_key


def _nobody(event: Any) -> None:
    """A follower's requests have no client: rank 0 answers them."""


def rank_bytes(model: Any, group: mx.distributed.Group, pipeline: bool) -> Callable[[Any], int]:
    """How a rank's cache counts stored arrays: as the rank whose shard of the KV is
    largest would hold them. Every rank then counts the same bytes for the same tokens
    (so all evict alike), and no rank holds more than its budget.

    Measured with one token through a fresh cache: a forward pass, so every rank
    calls this together.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from mlx_cache_server.prompt_cache import layers

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    own = layers.nbytes([c.state for c in cache])
    # Split by layers, ranks hold different layers, whose bytes grow alike with the tokens
    # only if every one keeps plain KV (not a sliding window, not a recurrent state).
    other = any(type(c) is not KVCache for c in cache)
    sizes = [own if rank == group.rank() else 0 for rank in range(group.size())]
    sizes = mx.distributed.all_sum(mx.array([*sizes, other], mx.int32), group=group,
                                   stream=mx.cpu).tolist()  # fmt: skip
    largest = max(sizes[:-1])
    if pipeline and sizes[-1]:  # decided alike on every rank: the sum is everyone's
        raise ValueError(
            "this model's layers keep more than plain KV (sliding windows or recurrent "
            "state), so split by layers its ranks would count their caches apart: serve it "
            "split by heads (without --pipeline)"
        )
    if own == largest:
        return layers.nbytes
    return lambda tree: layers.nbytes(tree) * largest // own
