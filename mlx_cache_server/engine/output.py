"""What one generated token adds to a request's output: text, stop strings, logprobs."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .events import Candidate, Delta, TokenLogprob
from .request import Request
from .text import token_bytes


def next_output(
    request: Request, tokenizer: Any, token: int, logprobs: mx.array, finish: str | None
) -> tuple[Delta, str | None]:
    """The delta `token` adds, and why the request ends with it ("stop", "length") or None.

    `finish` is the batch's own reason (an end token or max_tokens); a stop
    string found in the text ends the request too. Text that may still become a
    stop string is held back until ruled out.
    """
    request.generated += 1
    at_eos = finish == "stop"  # an end token: not part of the text
    if not at_eos:
        request.detok.add_token(token)
    if finish is not None:
        request.detok.finalize()
    text = request.stops.feed(request.detok.last_segment)
    k = request.params.logprobs
    lps = [] if at_eos or k is None else [token_logprob(tokenizer, token, logprobs, k)]
    n = request.generated
    if request.stops.stopped:
        return Delta(text, lps, n), "stop"
    if finish is not None:
        return Delta(text + request.stops.flush(), lps, n), finish
    return Delta(text, lps, n), None


def token_logprob(tokenizer: Any, token: int, logprobs: mx.array, k: int) -> TokenLogprob:
    """`token`'s logprob with the `k` most likely tokens of the same step."""
    top: list[Candidate] = []
    if k > 0:
        ids = mx.argpartition(-logprobs, k - 1)[:k]
        vals = logprobs[ids]
        order = mx.argsort(-vals)
        ids, vals = ids[order].tolist(), vals[order].tolist()
        top = [_candidate(tokenizer, i, v) for i, v in zip(ids, vals, strict=True)]
    token = int(token)
    chosen = _candidate(tokenizer, token, logprobs[token].item())
    return TokenLogprob(**chosen.__dict__, top=top)


def _candidate(tokenizer: Any, token: int, logprob: float) -> Candidate:
    return Candidate(token, tokenizer.decode([token]), token_bytes(tokenizer, token), logprob)
