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

# Ids from here up stand for something other than text in a prompt (a vision model's image
# positions: `models.vision`); anything that indexes the vocabulary by a token is given
# token 0 in their place, since MLX checks no index and would read out of bounds.
NON_TEXT = 1 << 30


def text_only(tokens: mx.array) -> mx.array:
    """`tokens` with every id of `NON_TEXT` and up as 0."""
    return mx.where(tokens >= NON_TEXT, 0, tokens)


def make_sampler(
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> Sampler:
    """Greedy at temperature 0; otherwise filtered categorical sampling (`Categorical`)."""
    if temperature == 0:
        return greedy_sampler
    return Categorical(temperature, top_p, top_k, min_p, seed)


class Categorical:
    """Filtered categorical sampling at a temperature.

    With a seed the request draws from its own key, so its draws do not depend on what
    else is running in the batch (its logits may: a batch of other streams sums the
    matrix products in another order, see docs/api.md's Reproducibility). The key is
    split once a draw and kept in `key`: a step that draws for positions it then throws
    away (a verified draft, `speculative`) puts back the key of the draws it kept, so a
    seeded reply is the one plain steps give.
    """

    def __init__(
        self, temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None
    ) -> None:
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.key = mx.random.key(seed) if seed is not None else None

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        logits = logprobs * (1 / self.temperature)
        if self.key is None:
            return mx.random.categorical(logits)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logits, key=draw)


def make_processors(
    logit_bias: dict[int, float] | None,
    presence_penalty: float,
    frequency_penalty: float,
) -> list:
    # A bias reads no context; the penalties count it by id: only they need `text_only`.
    biases = make_logits_processors(logit_bias=logit_bias or None)
    penalties = make_logits_processors(
        presence_penalty=presence_penalty or None,
        frequency_penalty=frequency_penalty or None,
    )
    return [*biases, *(_on_text(p) for p in penalties)]


def _on_text(processor: Callable) -> Callable:
    """`processor` (a penalty counts tokens by id) given its context `text_only`."""

    def call(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(text_only(tokens), logits)

    return call
