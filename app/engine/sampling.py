"""Per-request samplers and logits processors on top of mlx-lm's."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

Sampler = Callable[[mx.array], mx.array]


def make_sampler(
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> Sampler:
    """Greedy at temperature 0; otherwise filtered categorical sampling.

    With a seed the request draws from its own key, so its output does not
    depend on what else is running in the batch.
    """
    if temperature == 0:
        return greedy_sampler
    key = [mx.random.key(seed)] if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        logits = logprobs * (1 / temperature)
        if key is None:
            return mx.random.categorical(logits)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logits, key=draw)

    return sample


def make_processors(
    logit_bias: dict[int, float] | None,
    presence_penalty: float,
    frequency_penalty: float,
) -> list:
    return make_logits_processors(
        logit_bias=logit_bias or None,
        presence_penalty=presence_penalty or None,
        frequency_penalty=frequency_penalty or None,
    )
