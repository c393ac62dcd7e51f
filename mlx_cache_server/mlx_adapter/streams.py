"""The state of mlx-lm's `GenerationBatch` (the streams) that a step of ours reads and sets.

A `GenerationBatch` keeps, besides its public lists, each row's token sampled for the next
step and its logprobs (`_next_tokens`, `_next_logprobs`), the tokens each row has emitted
(`_num_tokens`, against `max_tokens`) and each row's stop-sequence matcher (`_matchers`).
A step that is not the batch's own (`decode_through`, the engine's verification step)
keeps them as `GenerationBatch.next` does, through these functions only.

Invariants: after a step of ours, the batch's state is the state its own `next` leaves:
`set_next` for each kept row's next token, `finish_reason` for each emitted token.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

# mlx-lm's generate module itself (the package's `generate` names its function).
GENERATE = importlib.import_module("mlx_lm.generate")

Forward = Callable[..., mx.array]  # forward(inputs, cache=caches) -> logits


def next_tokens(batch: GenerationBatch) -> mx.array | None:
    """Each row's token for the next step (sampled, maybe not yet evaluated); None when
    the batch has no rows."""
    return batch._next_tokens


def next_logprobs(batch: GenerationBatch) -> list[mx.array]:
    """Each row's logprobs over the vocabulary for the token `next_tokens` gives it."""
    return batch._next_logprobs


def set_next(batch: GenerationBatch, tokens: mx.array, logprobs: list[mx.array]) -> None:
    """Give each row its token for the next step and that token's logprobs."""
    batch._next_tokens, batch._next_logprobs = tokens, logprobs


def emitted_counts(batch: GenerationBatch) -> list[int]:
    """How many tokens each row has emitted (what `max_tokens` bounds); a copy."""
    return list(batch._num_tokens)


def finish_reason(batch: GenerationBatch, row: int, token: int) -> str | None:
    """Count `token` as emitted by `row` and say whether it ends the row: "stop" where
    the row's stop sequences end with it, "length" where it is the row's last, else None
    (as `GenerationBatch.next` decides it)."""
    batch._num_tokens[row] += 1
    reason = "length" if batch._num_tokens[row] >= batch.max_tokens[row] else None
    if batch._matchers[row].advance(token):
        reason = "stop"
    return reason


def decode_through(batch: GenerationBatch, forward: Forward) -> list[Any]:
    """`batch.next()`, its forward pass `forward(inputs, cache=batch.prompt_cache)` in
    place of the batch's model: the same sampling, bookkeeping and responses (a row that
    ends is filtered out and hands its cache over), the logits `forward`'s."""
    if not batch.uids:
        return []
    tokens, logprobs = _step(batch, forward)
    keep, responses = [], []
    for i, (uid, token) in enumerate(zip(batch.uids, tokens, strict=True)):
        reason = finish_reason(batch, i, token)
        if reason is None:
            keep.append(i)
            responses.append(batch.Response(uid, token, logprobs[i], None, None, None))
            continue
        cache, all_tokens = batch.extract_cache(i), batch.tokens[i]
        responses.append(batch.Response(uid, token, logprobs[i], reason, cache, all_tokens))
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    return responses


def _step(batch: GenerationBatch, forward: Forward) -> tuple[list[int], list[mx.array]]:
    """`GenerationBatch._step` (mlx-lm 0.32) with `forward` for the model: the tokens the
    step emits and their logprobs; the next step's tokens sampled and set going."""
    batch._current_tokens = inputs = batch._next_tokens
    batch._current_logprobs = batch._next_logprobs
    logits = forward(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
    context = []
    if any(batch.logits_processors):
        rows = []
        for e in range(len(batch.uids)):
            row = logits[e : e + 1]
            processors = batch.logits_processors[e] or ()
            if processors:
                seen = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
                context.append(seen)
                for processor in processors:
                    row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    # The `logsumexp` mlx-lm's own step calls: its module's `mx`, which the CPU fast path
    # may have given a faster one.
    logprobs = logits - GENERATE.mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [batch.fallback_sampler if s is None else s
                for s in (batch.samplers or [None] * len(batch.uids))]  # fmt: skip
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else batch.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)])
    batch._next_tokens, batch._next_logprobs = sampled, list(logprobs)
    mx.async_eval(batch._next_tokens, batch._next_logprobs, context)
    mx.eval(inputs, batch._current_logprobs)
    emitted = inputs.tolist()
    for held, token in zip(batch.tokens, emitted, strict=True):
        held.append(token)
    return emitted, batch._current_logprobs
