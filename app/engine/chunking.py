"""How many prompt tokens to prefill in a step that also decodes running streams.

mlx-lm's `BatchGenerator` runs, each step, one decode step of the running streams
and one chunk of every prompt being prefilled; the streams wait for both. A fixed
chunk makes that wait whatever the chunk costs: seconds on a CPU. Here the chunk is
sized each step from measured costs so that a step stays within `target_gap`
seconds, the longest a stream should wait between two tokens, as vLLM's and SGLang's
chunked prefill bound a step by a token budget; with nothing decoding, the prompt
gets the largest chunk, since nobody waits on it.

The policy is pure (`chunk_size`); `StepCosts` keeps the measurements it reads:
the decode step's time and the prefill's time per token, each a moving average
(attention makes a token cost more the longer the prompt already prefilled: the
average follows it).

Invariants: a chunk is at least `min_chunk` tokens (progress even when decoding
alone nearly fills the gap) and at most `max_chunk`; with no measurement yet the
chunk is `min_chunk` while streams decode.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest measurement in each moving average


@dataclass
class StepCosts:
    """Moving averages of the costs, each read as at least its latest measurement: a cost
    that just rose (a longer context, more streams) counts at once, one that fell slowly."""

    decode: float | None = None  # seconds for one decode step of the running streams
    per_token: float | None = None  # seconds per prefilled token
    last_decode: float = 0.0
    last_per_token: float = 0.0

    def saw_decode(self, seconds: float) -> None:
        self.decode = _average(self.decode, seconds)
        self.last_decode = seconds

    def saw_prefill(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.per_token = _average(self.per_token, seconds / tokens)
            self.last_per_token = seconds / tokens


def chunk_size(
    costs: StepCosts, decoding: bool, target_gap: float, min_chunk: int, max_chunk: int
) -> int:
    """The prefill chunk for the next step."""
    if not decoding:
        return max_chunk
    if costs.per_token is None:
        return min_chunk
    room = target_gap - max(costs.decode or 0.0, costs.last_decode)
    return max(min_chunk, min(max_chunk, int(room / max(costs.per_token, costs.last_per_token))))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
