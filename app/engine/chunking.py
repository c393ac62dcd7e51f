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

Invariants: the prompts prefilled in one step share the budget; together they get
at least `min_chunk` tokens (progress even when decoding alone nearly fills the
gap) and each at most `max_chunk`; with no measurement yet they share `min_chunk`
while streams decode.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest measurement in each moving average
MIN_MEASURED = 16  # a step that prefilled fewer tokens says little about the cost of one
OUTLIER = 4.0  # a measurement is taken as at most this many times the average


@dataclass
class StepCosts:
    """Moving averages of the costs, each read as at least its latest measurement: a cost
    that just rose (a longer context, more streams) counts at once, one that fell slowly.
    Measurements are a step's wall time, what the running streams wait for."""

    decode: float | None = None  # seconds for one decode step of the running streams
    per_token: float | None = None  # seconds per prefilled token
    last_decode: float = 0.0
    last_per_token: float = 0.0

    def saw_decode(self, seconds: float) -> None:
        self.last_decode = _bounded(self.decode, seconds)
        self.decode = _average(self.decode, self.last_decode)

    def saw_step(self, seconds: float, tokens: int, decoded: bool) -> None:
        """A step that prefilled `tokens` (and decoded the running streams, if `decoded`)
        in `seconds`: the prefill's share is what the decode step does not account for."""
        if tokens == 0:
            if decoded:
                self.saw_decode(seconds)
            return
        if tokens < MIN_MEASURED:
            return
        prefill = seconds - (max(self.decode or 0.0, 0.0) if decoded else 0.0)
        self.last_per_token = _bounded(self.per_token, max(prefill, 0.0) / tokens)
        self.per_token = _average(self.per_token, self.last_per_token)


def chunk_size(
    costs: StepCosts,
    decoding: bool,
    target_gap: float,
    min_chunk: int,
    max_chunk: int,
    prompts: int = 1,
) -> int:
    """Tokens each of `prompts` prompts may prefill in the next step: together, within the
    gap while streams decode (mlx-lm gives every prompt being prefilled its own chunk)."""
    prompts = max(1, prompts)
    floor = max(1, min_chunk // prompts)
    if not decoding:
        return max_chunk
    if not costs.per_token:
        return floor
    room = target_gap - max(costs.decode or 0.0, costs.last_decode)
    per_token = max(costs.per_token, costs.last_per_token)
    return max(floor, min(max_chunk, int(room / per_token / prompts)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def _bounded(average: float | None, new: float) -> float:
    # One stall (a collection, a page fault storm) must not shrink chunks for long.
    return new if average is None else min(new, OUTLIER * average)
