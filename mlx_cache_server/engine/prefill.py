"""A lone request's prefill, ending in its first token sampled from the prompt's own logits.

`BatchGenerator` prefills all but the last prompt token and produces the first
token with a separate one-token decode step; on a bandwidth-bound machine that
step costs as much as prefilling dozens of tokens. A request admitted on its
own whose uncached prompt fits in one step skips it here, then joins the batch
with its first token as its prompt. A longer one goes through the batch in
chunks, so that prompts arriving meanwhile can start beside it, and comes back
here for its last chunk when no other prompt is prefilling (`PromptSteps.last_chunk`).
Requests admitted together keep the batched path, which prefills them in one
forward pass. (`python -m bench ttft-floor` measures a warm turn's TTFT against
prefilling its new tokens plus one decode step: bench/results/ttft_floor.json.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..mlx_adapter.last_logits import last_logits
from ..runtime import cpu_logprobs
from .positions import PLAIN, Positions


def prefill_alone(
    model: Any,
    tokens: list[int],
    cache: list[Any],
    n_cached: int,
    step: int,
    sampler: Callable,
    processors: list[Callable],
    checkpoints: Sequence[int] = (),
    at_checkpoint: Callable[[int], None] | None = None,
    positions: Positions = PLAIN,
) -> tuple[int, mx.array]:
    """Run `tokens[n_cached:]` into `cache` in chunks of `step`; the first token and its
    logprobs (one row). A chunk also ends at each of `checkpoints`, where
    `at_checkpoint(position)` is called with the cache holding that many tokens. Each pass
    runs where `positions` says its tokens stand."""
    marks = {p for p in checkpoints if n_cached < p < len(tokens)}
    bounds = sorted({*range(n_cached, len(tokens), step), *marks})
    for at, end in zip(bounds[:-1], bounds[1:], strict=True):
        # Evaluated one by one: activations stay one step's size.
        with positions.prefilling([(tokens[:at], tokens[at:end])]):
            model(mx.array(tokens[at:end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        if end in marks and at_checkpoint is not None:
            at_checkpoint(end)
    with positions.prefilling([(tokens[: bounds[-1]], tokens[bounds[-1] :])]):
        logits = last_logits(model, mx.array(tokens[bounds[-1] :])[None], cache)
    token, logprobs = sample(logits, tokens, sampler, processors)
    return int(token.item()), logprobs[0]


def sample(
    logits: mx.array, tokens: list[int], sampler: Callable, processors: list[Callable]
) -> tuple[mx.array, mx.array]:
    """The next token after `tokens` and the logprobs it was drawn from (one row each),
    evaluated: `logits` through the processors, normalized, sampled."""
    if processors:
        context = mx.array(tokens, dtype=mx.int32)
        for processor in processors:
            logits = processor(context, logits)
    # One row: MLX's normalization (`cpu_logprobs` leaves one or two rows to it), as the
    # batch's own for a step of one or two streams.
    logprobs = logits - cpu_logprobs.logsumexp(logits, axis=-1, keepdims=True)
    token = sampler(logprobs)
    mx.eval(token, logprobs)
    return token, logprobs
