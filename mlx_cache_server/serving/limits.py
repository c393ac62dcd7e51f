"""The bounds a request is checked against before it may generate, and its slot.

Every check raises `APIError` with the status and the parameter a client needs
to fix its request; nothing here touches the engine's state except the slot.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Container
from typing import Any

from pydantic import BaseModel

from ..engine import Engine, SamplingParams
from ..settings import Settings
from .api_errors import APIError
from .defaults import SamplingDefaults
from .openai_bodies import SamplingFields

log = logging.getLogger("mlx_cache_server.requests")

MAX_STOP_SEQUENCES = 16


class Slot:
    """A request's place in the server's capacity (`Engine.in_flight`), from admission to end.

    Taken before the prompt is tokenized, so requests that arrive together are
    counted together. Freed once: by `tracked` when the request ends, by the
    handler when it fails before generating, or when the slot is dropped unused
    (a streaming response whose client left before it started).
    """

    def __init__(self, engine: Engine) -> None:
        with _COUNT:
            engine.in_flight += 1
        self._after: list[Callable[[], None]] = []  # run when it is freed: `on_release`
        self.release = weakref.finalize(self, _free_slot, engine, self._after)

    def on_release(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the slot is freed, however the request ends (a vision model's
        images are held so, `ImageIds.release`)."""
        self._after.append(fn)


_COUNT = threading.Lock()  # a slot dropped unused is freed by the garbage collector, any thread


def _free_slot(engine: Engine, after: list[Callable[[], None]]) -> None:
    with _COUNT:
        engine.in_flight -= 1
    for fn in after:
        fn()


def reserve_slot(engine: Engine, settings: Settings) -> Slot:
    if engine.in_flight >= engine.completion_batch_size + settings.max_queue:
        raise APIError(
            429,
            f"The server is busy: {engine.in_flight} requests are in flight. Retry shortly.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return Slot(engine)


def prompt_char_bound(engine: Engine) -> int:
    """The most characters a prompt that fits the context can have, whatever its tokens.

    No token stands for more characters than the longest in the vocabulary, so past
    `context_length` times that many characters the prompt is too long; the factor 2
    leaves room for normalizers that fold several characters into one.
    """
    return 2 * engine.context_length * engine.max_token_chars


def check_prompt_chars(chars: int, engine: Engine, param: str) -> None:
    """Refuse, before templating or tokenizing it, a prompt that cannot fit the context
    whatever its tokens (`prompt_char_bound`). Tokenizing a body of megabytes takes
    seconds that this check does not."""
    if chars > prompt_char_bound(engine):
        raise APIError(
            400,
            f"This model's maximum context length is {engine.context_length} tokens, and "
            f"the prompt's {chars} characters are far more than that. Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def text_chars(*values: Any, stop_after: int | None = None) -> int:
    """Characters of `values` written out as text: every string (dicts' keys too) and
    every other scalar as its JSON, each container its brackets and separators at least,
    pydantic models by their fields' values. Walked without recursion, so any nesting is
    measured; past `stop_after` the walk ends, returning what it has counted so far. An
    image's data URL (a `url` holding one) counts as one character: it is never tokenized
    as text (`images` bounds it)."""
    total, stack = 0, list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            total += 2 + sum(1 + (len(k) if isinstance(k, str) else 1) for k in value)
            for key, item in value.items():
                image = key == "url" and isinstance(item, str) and item.startswith("data:image/")
                total += 1 if image else 0
                stack.extend([] if image else [item])
        elif isinstance(value, list | tuple):
            total += 2 + len(value)
            stack.extend(value)
        elif isinstance(value, BaseModel):
            stack.extend(value.__dict__.values())
            stack.append(value.__pydantic_extra__)
        elif value is None:
            total += 4
        else:
            total += len(str(value))
        if stop_after is not None and total > stop_after:
            break
    return total


def check_model(name: str, engine: Engine, aliases: Container[str]) -> None:
    if name not in aliases:
        raise APIError(
            404,
            f"The model '{name}' does not exist. This server serves '{engine.model_id}'; "
            "list models with GET /v1/models.",
            param="model",
            code="model_not_found",
        )


def sampling_params(
    req: SamplingFields,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    logprobs: int | None,
    engine: Engine,
    settings: Settings,
    defaults: SamplingDefaults,
    prompt_param: str,
) -> SamplingParams:
    """The engine's parameters for a request, or a 400 naming what is out of bounds.

    A max_tokens past the server's cap or the context's room is lowered to fit,
    on every API: agents ask for far more than a small model's context holds and
    expect to be stopped at max_tokens (one that got a 400 compacted its history
    and asked again, forever). A prompt that alone does not fit stays a 400.
    """
    if req.n != 1:
        raise APIError(400, "Only n=1 is supported; send several requests instead.", param="n")
    room = engine.context_length - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(room, settings.default_max_tokens)
    elif max_tokens > min(room, settings.max_tokens_cap):
        fits = min(room, settings.max_tokens_cap)
        log.info(
            "max_tokens %d lowered to %d: %s", max_tokens, fits,
            f"the prompt's {prompt_tokens} tokens leave that much of the {engine.context_length}"
            "-token context" if fits == room else "the server's max_tokens_cap",
        )  # fmt: skip
        max_tokens = fits
    top_k = defaults.top_k if req.top_k is None else req.top_k
    if top_k > engine.vocab_size:
        raise APIError(
            400,
            f"top_k must be at most the vocabulary size, {engine.vocab_size}; got {top_k}.",
            param="top_k",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES:
        raise APIError(
            400, f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", param="stop"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=0 if top_k == engine.vocab_size else top_k,  # all of it: no filter
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=stop,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias, engine.vocab_size),
        logprobs=logprobs,
    )


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise APIError(
                400,
                f"logit_bias keys must be token ids in [0, {vocab}); got {key!r}.",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise APIError(400, "logit_bias values must be in [-100, 100].", param="logit_bias")
        out[token] = value
    return out
