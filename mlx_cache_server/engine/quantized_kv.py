"""Quantized KV (`--kv-bits`): the running requests take turns, one forward pass each.

mlx-lm's `BatchGenerator` batches plain KV caches only (there is no batched
`QuantizedKVCache`), and mlx_lm.server runs quantized KV one request after another.
Here every running request keeps its own cache and, each step, gets a forward pass of
its own: a decode step for each stream, and one prefill chunk for the oldest prompt,
sized like the batch's (`chunking`) so the streams keep flowing. Prompts are
prefilled one at a time, in arrival order: each starts from what the cache holds
when its turn comes, so a system prompt shared by requests that arrived together is
prefilled once.

KV is quantized from the first token on, never partway through a sequence: the
stored KV of a token is then the same whether its prefix came from the cache or was
computed by the request itself, which is what keeps greedy output with the cache
equal to output without it at the same `--kv-bits`.

Invariants: `active` maps the uid of every admitted, unended request to it, and
`runs` holds its state; a failure inside one request's forward pass, sampler or
processors ends that request only.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_cache_server.prompt_cache.layers import mode_of

from ..mlx_adapter.last_logits import last_logits
from .chunking import StepCosts, chunk_size
from .events import Finished, Started, log_fault, sampling_failed
from .exits import State, deliver, store
from .positions import PLAIN
from .prefill import sample
from .request import Request
from .text import StopMatcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from .wiring import BatchSettings, Fail, Outlet

log = logging.getLogger("mlx_cache_server.engine")

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports
KV_GROUP_SIZES = (32, 64, 128)


def quantized_cache(model: Any, group_size: int, bits: int) -> list[Any]:
    """An empty cache for `model` whose attention layers quantize their KV as it is
    written; a hybrid model's other layers (sliding windows, recurrent state) as they are."""
    cache = make_prompt_cache(model)
    if mode_of(cache) == "snapshot":
        kinds = {type(c).__name__ for c in cache}
        raise ValueError(
            f"--kv-bits needs a model whose layers keep a plain KV cache, a sliding window "
            f"or a recurrent state; this one keeps {', '.join(sorted(kinds))}. Leave "
            "--kv-bits out for it."
        )
    return [QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c
            for c in cache]  # fmt: skip


def check_quantized(model: Any, group_size: int, bits: int) -> None:
    """Raise a ValueError saying why this model cannot run with this quantization."""
    if bits not in KV_BITS:
        raise ValueError(f"--kv-bits must be one of {KV_BITS}, not {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(f"--kv-group-size must be one of {KV_GROUP_SIZES}, not {group_size}")
    cache = quantized_cache(model, group_size, bits)
    try:
        mx.eval(model(mx.array([[0]]), cache=cache))
    except Exception as e:  # the head size is not a multiple of the group size, say
        raise ValueError(
            f"this model cannot keep {bits}-bit KV in groups of {group_size}: {e}. "
            "Try another --kv-group-size."
        ) from e


@dataclass(eq=False)
class _Run:
    """A request's own state: its cache holds the KV of `fed`, the tokens run so far."""

    request: Request
    cache: list[Any] | None = None  # None until its prefill starts
    fed: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet run through the model
    sampler: Any = None
    processors: list[Callable] = field(default_factory=list)
    shift: int | None = None  # where its decoded tokens stand (`engine.positions`), once known

    @property
    def prefilling(self) -> bool:
        return self.next_token is None


class QuantizedKVRunner:
    """Runs quantized-KV requests in turns, each on its own cache, behind the `Batch`
    interface (`intake`, `step`, `drop_cancelled`, `active`)."""

    def __init__(
        self,
        model: Any,
        outlet: Outlet,
        settings: BatchSettings,
        fail: Fail,
        group_size: int,
        bits: int,
    ) -> None:
        """`fail`: the engine thread's, for a request whose own forward pass failed."""
        self.model = model
        self.outlet = outlet
        self.settings = settings
        self._fail = fail
        self.group_size, self.bits = group_size, bits
        self.active: dict[int, Request] = {}
        self.runs: dict[int, _Run] = {}
        self.queue: list[tuple[Request, float]] = []  # unused: prompts wait in `runs`, in order
        self.costs = StepCosts()  # measured here: a sharded server runs no quantized KV
        self.cost = None
        self.now = 0.0
        self._uids = itertools.count()
        # Where the model's passes stand (`engine.positions`).
        self.positions = settings.generator.get("positions", PLAIN)

    def close(self) -> None:
        self.runs.clear()
        self.active.clear()

    @property
    def busy(self) -> bool:
        return bool(self.active)

    def everyone(self) -> list[Request]:
        return list(self.active.values())

    def intake(self, new: list[Request]) -> None:
        for request in new:
            if request.cancelled:
                request.end(Finished("cancelled", 0))
                continue
            request.uid = next(self._uids)
            request.prefilling = True
            self.active[request.uid] = request
            self.runs[request.uid] = _Run(request)

    # ----------------------------------------------------------------- steps

    def step(self) -> None:
        """A decode step for every stream, then a prefill chunk of the oldest prompt."""
        decoding = [run for run in self.runs.values() if not run.prefilling]
        prompt = next((run for run in self.runs.values() if run.prefilling), None)
        with mx.stream(generation_stream):
            if decoding:
                start = time.perf_counter()
                for run in decoding:
                    self._guarded(run, self._decode)
                self.costs.saw_decode(time.perf_counter() - start)
            if prompt is not None:
                start = time.perf_counter()
                tokens = self._guarded(prompt, self._prefill) or 0
                depth = len(prompt.fed) - tokens / 2
                self.costs.saw_step(time.perf_counter() - start, tokens, False, depth)

    def _guarded(self, run: _Run, fn: Callable[[_Run], int | None]) -> int | None:
        request = run.request
        try:
            out = fn(run)
        except Exception:  # this request's forward pass failed: it alone ends
            log.exception("a request failed in its own forward pass")
            self._leave(run)
            self._fail([request], "Generation failed on the server. Retry.")
            return None
        if request.fault is not None and not request.ended:
            log_fault(request.fault)
            self._leave(run)
            request.end(sampling_failed(request.fault))
            self.outlet.stats.failed += 1
        return out

    def _prefill(self, run: _Run) -> int:
        """One chunk of the prompt; the last one samples the first token. Tokens run."""
        request, s = run.request, self.settings
        tokens = request.tokens
        if run.cache is None:
            self._start(run)
        at = len(run.fed)
        decoding = any(not r.prefilling for r in self.runs.values())
        chunk = chunk_size(self.costs, decoding, s.decode_gap, s.min_prefill_chunk,
                           s.prefill_step_size, depth=at)  # fmt: skip
        # A hybrid model's chunk ends where its cache is to be checkpointed, and is stored there.
        mark = next((p for p in request.params.checkpoints if p > at), None)
        if mark is not None:
            chunk = min(chunk, mark - at)
        if len(tokens) - at > chunk:
            with self.positions.prefilling([(tokens[:at], tokens[at : at + chunk])]):
                self.model(mx.array(tokens[at : at + chunk])[None], cache=run.cache)
            mx.eval([c.state for c in run.cache])
            run.fed = tokens[: at + chunk]
            if at + chunk == mark:
                store(self.outlet, request, (run.cache, run.fed))
            return chunk
        with self.positions.prefilling([(tokens[:at], tokens[at:])]):
            logits = last_logits(self.model, mx.array(tokens[at:])[None], run.cache)
        run.fed = list(tokens)
        request.prefilling = False
        # Cached now, not only when it ends: a request waiting behind this one with the
        # same system prompt starts from it.
        store(self.outlet, request, (run.cache, run.fed))
        self._sample(run, logits)
        return len(tokens) - at

    def _start(self, run: _Run) -> None:
        request, outlet = run.request, self.outlet
        n = 0
        if outlet.cache is not None:
            found = outlet.cache.fetch(request.cache_key, request.packed)
            run.cache, n = found.cache, found.n_cached
        if run.cache is None:
            run.cache = quantized_cache(self.model, self.group_size, self.bits)
        run.fed = request.tokens[:n]
        request.detok = outlet.tokenizer.detokenizer
        request.stops = StopMatcher(request.params.stop)
        run.sampler, run.processors = request.sampling()
        outlet.stats.admitted += 1
        request.emit(Started(prompt_tokens=len(request.tokens), cached_tokens=n))

    def _decode(self, run: _Run) -> None:
        token = run.next_token
        if run.shift is None:
            run.shift = self.positions.shift(run.fed)
        with self.positions.decoding([run.shift]):
            logits = self.model(mx.array([[token]]), cache=run.cache)[:, -1, :]
        run.fed.append(token)
        self._sample(run, logits)

    def _sample(self, run: _Run, logits: mx.array) -> None:
        request, outlet = run.request, self.outlet
        token, logprobs = sample(logits, run.fed, run.sampler, run.processors)
        if request.fault is not None:
            return
        token = int(token.item())
        finish = None
        if token in outlet.tokenizer.eos_token_ids:
            finish = "stop"
        elif request.generated + 1 >= request.params.max_tokens:
            finish = "length"
        run.next_token = token
        if deliver(outlet, request, token, logprobs[0], finish, lambda: self._state(run)):
            self._leave(run)

    @staticmethod
    def _state(run: _Run) -> State:
        return run.cache, run.fed

    def _leave(self, run: _Run) -> None:
        self.active.pop(run.request.uid, None)
        self.runs.pop(run.request.uid, None)

    # ----------------------------------------------------------------- exits

    def drop_cancelled(self) -> None:
        for run in [run for run in self.runs.values() if run.request.cancelled]:
            request = run.request
            self._leave(run)
            request.end(Finished("cancelled", request.generated))
            if run.cache is not None:  # admitted (`_start`): counted as the batch counts
                store(self.outlet, request, self._state(run))
                self.outlet.stats.cancelled += 1
