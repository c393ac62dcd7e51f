"""A decode step that verifies a draft: a lone greedy stream's next tokens in one pass.

mlx-lm's `GenerationBatch` decodes one token a sequence a step, the token it sampled at
the step before (`_next_tokens`) going in as the step's input. Here, for a batch of one
sequence, that token goes in followed by a draft of k more (`drafting`), in one forward
pass over k+1 positions. The model's greedy choice after each position says how much of
the draft it would have produced itself: those tokens are emitted as if decoded one by
one, the rest's KV is trimmed off, and the model's choice after the last accepted token
becomes the next step's input, as a plain step would have left it.

Invariants: the tokens emitted are the ones plain greedy steps would emit (each chosen
by the same argmax over the same context); the batch's caches hold the KV of exactly the
tokens in `tokens` (what a finished sequence's cache goes to the prompt cache with);
`max_tokens` and the stop tokens end the sequence at the token they would have, and
nothing past it is emitted.

Only where trimming the caches undoes the rejected tokens (`BatchKVCache` layers),
for a greedy sampler and no logits processors (a grammar, biases, penalties: they would
have to see each drafted token before it is verified).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from ..runtime import cpu_logprobs


def can_verify(batch: GenerationBatch) -> bool:
    """Whether `batch` is one greedy sequence whose caches a trim rolls back."""
    return (
        len(batch.uids) == 1
        and batch._next_tokens is not None
        and (batch.samplers or [None])[0] in (None, greedy_sampler)
        and not (batch.logits_processors or [None])[0]
        and all(_trimmable(c) for c in batch.prompt_cache)
    )


def _trimmable(cache: Any) -> bool:
    # By its trim: subclasses that only change how a sequence is handed out qualify.
    return isinstance(cache, BatchKVCache) and type(cache).trim is BatchKVCache.trim


def verify(batch: GenerationBatch, draft: list[int]) -> tuple[list[Any], int]:
    """One step of `batch` (see `can_verify`) taking `draft` in after its next token: the
    responses of every token emitted, in order, and how many of the draft were accepted."""
    first = batch._next_tokens
    inputs = mx.concatenate([first, mx.array(draft, dtype=first.dtype)])[None]
    logits = batch.model(inputs, cache=batch.prompt_cache)[0]
    # k+1 rows: numpy's vectorized exp where the CPU fast path is on (`cpu_logprobs`).
    logprobs = logits - cpu_logprobs.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.argmax(logprobs, axis=-1)
    mx.eval(chosen, logprobs, batch._next_logprobs)
    model_says = chosen.tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == model_says[accepted]:
        accepted += 1
    tokens = [int(first[0].item()), *draft[:accepted]]
    token_logprobs = [batch._next_logprobs[0], *(logprobs[i] for i in range(accepted))]
    emitted, reason = [], None
    for token, lp in zip(tokens, token_logprobs, strict=True):
        batch._num_tokens[0] += 1
        if batch._num_tokens[0] >= batch.max_tokens[0]:
            reason = "length"
        if batch._matchers[0].advance(token):
            reason = "stop"
        emitted.append((token, lp))
        if reason is not None:
            break
    for c in batch.prompt_cache:  # the KV of what was not emitted goes
        c.trim(len(draft) + 1 - len(emitted))
    batch.tokens[0].extend(t for t, _ in emitted)
    uid = batch.uids[0]
    out = [GenerationBatch.Response(uid, t, lp, None, None, None) for t, lp in emitted]
    if reason is not None:
        last = out[-1]
        last.finish_reason, last.all_tokens = reason, batch.tokens[0]
        last.prompt_cache = batch.extract_cache(0)
        batch.filter([])
        return out, accepted
    batch._next_tokens = chosen[len(emitted) - 1 : len(emitted)]
    batch._next_logprobs = [logprobs[len(emitted) - 1]]
    return out, accepted
