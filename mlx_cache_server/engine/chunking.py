"""How many prompt tokens to prefill in a step that also decodes running streams.

mlx-lm's `BatchGenerator` runs, each step, one decode step of the running streams
and one chunk of every prompt being prefilled (one forward pass for both when one
prompt is: `generator`); the streams wait for both (and for the side batch's decode
step, when one runs: `placement`; it is measured as part of the decode step). A
fixed chunk makes that wait whatever the chunk costs: seconds on a CPU. Here the
chunk is sized each step from measured costs so that a step stays within
`target_gap` seconds, the longest a stream should wait between two tokens, as vLLM's
and SGLang's chunked prefill bound a step by a token budget; with nothing decoding,
the prompt gets the largest chunk, since nobody waits on it.

A prompt token costs more the deeper in its prompt it is: its attention reads every
token before it. So a token's cost is read as a line in its depth, fitted to the
recent steps' measurements (`StepCosts.per_token`), and a chunk's cost is the sum
along that line from where the prompt stands. A single average would carry a deep
prompt's cost over to the start of the next one (chunks too small) and lag behind a
prompt going deeper (steps past the gap).

A line read beyond the depths it was fitted to is a guess: there a chunk is at most
twice the largest measured (each step measures the next depth), and a prompt starting
far deeper than anything measured (a long cached prefix) takes the smallest chunk first.

The policy is pure (`chunk_size`); `StepCosts` keeps the measurements it reads.

Invariants: the prompts prefilled in one step share the budget; together they get
at least `min_chunk` tokens (progress even when decoding alone nearly fills the
gap) and each at most `max_chunk`; with no measurement yet they share `min_chunk`
while streams decode; a measurement is positive; the cost of a token never reads
below the cheapest one measured.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of the newest measurement in the decode step's moving average
MIN_MEASURED = 16  # a step that prefilled fewer tokens says little about the cost of one
OUTLIER = 4.0  # a measurement is taken as at most this many times what was expected
WINDOW = 16  # prefill measurements the line is fitted to, the newest
RECENCY = 0.7  # weight of each measurement relative to the next newer one
MIN_SPREAD = 64  # the measurements' weighted standard deviation of depth to read a slope
STALE = 0.5  # with no token's cost known, a decode average above 1/STALE of a step is stale


@dataclass
class StepCosts:
    """What the steps measured: the decode step's time (a moving average of the steps that
    only decode, read as at least its latest measurement, and lowered to what a step that
    also prefilled leaves of itself) and the prefill's seconds per token at a depth in the
    prompt. Measurements are a step's wall time, what the running streams wait for."""

    decode: float | None = None  # seconds for one decode step of the running streams
    last_decode: float = 0.0
    # (depth the step's prompt tokens stood at, seconds per token, tokens), oldest first
    prefill: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def saw_decode(self, seconds: float) -> None:
        self.last_decode = _bounded(self.decode, seconds)
        self.decode = _average(self.decode, self.last_decode)

    def saw_step(self, seconds: float, tokens: int, decoded: bool, depth: float = 0.0) -> None:
        """A step that prefilled `tokens` at `depth` in their prompts (and decoded
        the running streams, if `decoded`) in `seconds`: the prefill's share is what the
        decode step does not account for."""
        if tokens == 0:
            if decoded:
                self.saw_decode(seconds)
            return
        if decoded and self.decode is not None:
            # The streams' step was part of this one, so it cost at most what the step's
            # tokens left of it, each at least the cheapest token measured. A decode average
            # above that is stale (a stall as the streams started, and no step has decoded
            # alone since), and would leave a prompt small chunks step after step.
            cheapest = self.cheapest()
            if cheapest is not None:
                bound = seconds - tokens * cheapest
            else:  # no token's cost known: the step itself, if far below the average
                bound = seconds if seconds < STALE * self.decode else self.decode
            if 0 < bound < self.decode:
                self.decode = self.last_decode = bound
        if tokens < MIN_MEASURED:
            return
        prefill = seconds - (max(self.decode or 0.0, 0.0) if decoded else 0.0)
        if prefill <= 0:  # within the decode step's own spread: says nothing of a token
            return
        cost = prefill / tokens
        if depth <= self.deepest():  # a guess beyond the line is no measure of a stall
            cost = _bounded(self.per_token(depth), cost)
        self.prefill.append((depth, cost, tokens))

    def cheapest(self) -> float | None:
        """The lowest seconds per token measured; None with no measurement."""
        return min((c for _, c, _ in self.prefill), default=None)

    def deepest(self) -> float:
        """The deepest measured depth; -1 with no measurement."""
        return max((d for d, _, _ in self.prefill), default=-1.0)

    def line(self) -> tuple[float, float] | None:
        """(seconds per token at depth 0, seconds more per token of depth): least squares
        over the measurements, the newer weighing more. No slope unless their depths'
        weighted standard deviation reaches `MIN_SPREAD` tokens, and none falling (a stall
        among shallow steps)."""
        if not self.prefill:
            return None
        n = len(self.prefill)
        weights = [RECENCY ** (n - 1 - i) for i in range(n)]
        total = sum(weights)
        points = [(w, d, c) for w, (d, c, _) in zip(weights, self.prefill, strict=True)]
        mean_d = sum(w * d for w, d, _ in points) / total
        mean_c = sum(w * c for w, _, c in points) / total
        var = sum(w * (d - mean_d) ** 2 for w, d, _ in points)
        if var / total < MIN_SPREAD**2:
            return mean_c, 0.0
        cov = sum(w * (d - mean_d) * (c - mean_c) for w, d, c in points)
        slope = max(cov / var, 0.0)
        return mean_c - slope * mean_d, slope

    def per_token(self, depth: float) -> float | None:
        """Seconds a prompt token at `depth` costs: on the line, and at least the newest
        measurement carried along its slope (a cost that just rose counts at once)."""
        line = self.line()
        if line is None:
            return None
        base, slope = line
        newest_d, newest_c, _ = self.prefill[-1]
        return max(base + slope * depth, newest_c + slope * (depth - newest_d), self.cheapest())


def chunk_size(
    costs: StepCosts,
    decoding: bool,
    target_gap: float,
    min_chunk: int,
    max_chunk: int,
    prompts: int = 1,
    depth: float = 0.0,
) -> int:
    """Tokens each of `prompts` prompts, the deepest `depth` tokens into its prompt, may
    prefill in the next step: together, within the gap while streams decode (mlx-lm gives
    every prompt being prefilled its own chunk)."""
    prompts = max(1, prompts)
    floor = max(1, min_chunk // prompts)
    if not decoding:
        return max_chunk
    first = costs.per_token(depth)
    line = costs.line()
    deepest = costs.deepest()
    if first is None or line is None or depth > 2 * deepest + max_chunk:
        return floor  # nothing measured, or nothing near this depth
    room = (target_gap - max(costs.decode or 0.0, costs.last_decode)) / prompts
    if room <= 0:
        return floor
    # c tokens from `depth` cost c * first + slope * c^2 / 2: the largest c within room.
    slope = line[1]
    if slope > 0:
        fits = (math.sqrt(first * first + 2 * slope * room) - first) / slope
    else:
        fits = room / first
    if depth + fits > deepest:  # past the measured depths: grow by steps, each measured
        fits = min(fits, 2 * max(n for _, _, n in costs.prefill))
    return max(floor, min(max_chunk, int(fits)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def _bounded(expected: float | None, new: float) -> float:
    # One stall (a collection, a page fault storm) must not shrink chunks for long.
    return new if not expected or expected <= 0 else min(new, OUTLIER * expected)
