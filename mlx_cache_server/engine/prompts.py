"""A prompt's prefill in the batch: a lone prompt prefilled whole and its first token
sampled from its own logits (`prefill.prefill_alone`), the last chunk of a long one
taken out of the generator to end the same way, and the prompt's KV stored into the
cache as it goes (at its end, at a prefix others wait for, at a hybrid model's
checkpoints, or chunk by chunk beside decoding streams).

`PromptSteps` is the batch's prompt stepper: it acts on the batch's `Running`, hands a
prompt's output to the batch's `Exits`, and lets those waiting on a prefix in (`release`)
or fails a start (`fail_start`) through the entering policy's callbacks it is handed.
Runs on the engine thread alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_cache_server.prompt_cache import as_fresh

from .exits import Exits, State
from .placement import MAIN
from .positions import PLAIN, Positions
from .prefill import prefill_alone
from .request import Request

if TYPE_CHECKING:
    from .running import Running

log = logging.getLogger("mlx_cache_server.engine")


class PromptSteps:
    def __init__(
        self,
        running: Running,
        model: Any,
        eos_token_ids: set[int],
        *,
        prefill_step_size: int,
        cached: bool,
        exits: Exits,
        release: Callable[[Request], None],
        fail_start: Callable[[Request], None],
        positions: Positions = PLAIN,
    ) -> None:
        """`cached`: whether the engine has a prompt cache to store prompts in; `positions`:
        where the model's passes stand (`engine.positions`)."""
        self.running = running
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.prefill_step_size = prefill_step_size  # the largest prefill chunk
        self.cached = cached
        self.exits = exits
        self._release, self._fail_start = release, fail_start
        self.positions = positions

    def start_alone(self, request: Request, cache: list, n: int, sampler, processors) -> float:
        """Prefill the prompt after its first `n` tokens in `cache` and sample its first
        token, then let it decode; the seconds the prefill took."""
        tokens = request.tokens
        start = time.perf_counter()

        def checkpoint(at: int) -> None:
            self.exits.store(request, (cache, tokens[:at]))

        with mx.stream(self.running.gen.stream):
            first, logprobs = prefill_alone(
                self.model, tokens, cache, n, self.prefill_step_size, sampler, processors,
                request.params.checkpoints, checkpoint, self.positions,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        if request.fault is not None:
            self.exits.fail_faulted(request)
            return seconds
        finish = "stop" if first in self.eos_token_ids else None
        if finish is None and request.params.max_tokens <= 1:
            finish = "length"
        if self.exits.deliver(request, first, logprobs, finish, lambda: (cache, tokens)):
            return seconds
        gen = self.running.gen if self.running.place(len(tokens)) == MAIN else self.running.side
        (request.uid,) = gen.insert(
            [[first]],
            max_tokens=[request.params.max_tokens - 1],
            caches=[cache],
            all_tokens=[list(tokens)],  # BatchGenerator appends to it
            samplers=[sampler],
            logits_processors=[processors],
        )
        self.running.active[request.uid] = request
        # Cached now, not only when it ends: requests that arrived during this
        # prefill (chats opening with this system prompt, say) reuse it at once.
        self.exits.store(request, (cache, tokens))
        return seconds

    def last_chunk(self, chunk: int) -> Request | None:
        """The prompt whose prefill ends with this step, if it is the only one prefilling
        and no request waits for a prefix boundary still ahead in it.

        It is taken out of the batch and finished alone (`finish_prefill`): its first
        token comes from its last chunk's logits, not from a one-token step after it, and
        reaches the client before it joins a decode batch (`Running.place`); the join could
        copy a whole batch's KV (`python -m bench mixed` measures the streams' gaps and the
        long prompt's TTFT: bench/results/mixed.json).
        """
        prefilling = self.running.prefilling()
        if len(prefilling) != 1:
            return None
        (request,) = prefilling
        done = len(request.tokens) - request.left
        if request.left > chunk or (request.followers and request.boundary > done):
            return None
        return request

    def take_out(self, request: Request) -> State:
        """`request`'s KV and tokens, taken out of the batch. The cache is `as_fresh`: it joins
        a batch again without a copy, and, the only holder of its buffers now, takes the
        rest of the prompt in its buffers' free slots in place."""
        taken = self.running.gen.remove([request.uid], return_prompt_caches=True)
        cache, tokens = taken[request.uid]
        return as_fresh(cache), tokens

    def finish_prefill(self, request: Request, cache: list[Any], tokens: list[int]) -> float | None:
        """Prefill the rest of `request`'s prompt after the KV `cache` holds for `tokens`,
        then let it decode (`start_alone`); the seconds its prefill took, None if it failed."""
        del self.running.active[request.uid]
        request.prefilling, request.left = False, 0
        try:
            sampler, processors = request.sampling()
            seconds = self.start_alone(request, cache, len(tokens), sampler, processors)
        except Exception:
            log.exception("finishing a prompt's prefill failed")
            self._fail_start(request)
            return None
        self._release(request)  # those waiting for its prefix: it is cached now
        return seconds

    def prefill_depth(self, chunk: int) -> float:
        """Where the tokens the next step prefills stand in their prompts, as their cost is
        measured at: mlx-lm pads the prompts of a step to the deepest one, so every token
        costs about what the deepest prompt's do. A prompt's last token is left out: the
        batch runs it as a decode step, `last_chunk` with the rest of the prompt."""
        prefilling = [r for r in self.running.prefilling() if r.left > 1]
        taken = [(len(r.tokens) - r.left, min(r.left - 1, chunk)) for r in prefilling]
        taken = taken[: self.running.gen.prefill_batch_size]
        if not taken:
            return 0.0
        return max(at for at, _ in taken) + max(n for _, n in taken) / 2

    def on_prefill(self, progress: Any) -> None:
        request = self.running.active.get(progress.uid)
        if request is None:
            return
        if not request.prefilling:
            # Prefilled alone (`start_alone`) and cached then: this is its first token
            # entering the batch. Storing it again would only copy the same KV, and reading
            # it from the batch would make this step evaluate the batch's join.
            return
        done, total = progress.progress
        request.left = total - done
        if progress.end_of_prompt:
            request.prefilling = False
        # Cached once prefilled, not only when it ends: a request that shares the prompt
        # and arrives while this one decodes starts from it.
        cached = self.cached
        # Those waiting for a prefix are let in at its end, not at a checkpoint before it.
        at_boundary = done >= request.boundary
        awaited = (cached and progress.end_of_prompt) or (
            request.followers and progress.end_of_segment and at_boundary
        )
        # A hybrid model's prompt is cut into segments where it is to be checkpointed.
        checkpoint = cached and progress.end_of_segment and bool(request.params.checkpoints)
        # Beside running streams its KV goes into the cache chunk by chunk too, each step
        # copying its own chunk's: the whole prompt's copy, taken at its first token, fell
        # into one step the streams waited for (`python -m bench mixed` measures the
        # streams' longest gap while a long prompt prefills).
        chunked = cached and not request.params.checkpoints and self._beside_streams(request)
        if awaited or checkpoint or chunked:
            kv = self.running.gen.extract_cache([progress.uid]).get(progress.uid)
            self.exits.store(request, kv)
        if awaited:
            self._release(request)

    def _beside_streams(self, request: Request) -> bool:
        """`request` is the one prompt being prefilled, and streams are decoding."""
        prefilling, active = self.running.prefilling(), self.running.active
        return len(prefilling) == 1 and prefilling[0] is request and len(active) > 1
