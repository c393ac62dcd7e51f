"""Which waiting prompts start prefilling now: shortest remaining first, with a bounded wait.

Prompts that arrive together (chats opening at once, an agent's long context beside
short questions) all wait for their first token, and what each waits is the prefill
of every prompt run before or beside it. Run shortest first, most of them wait only
for short ones: the median TTFT is the least any order gives (SRPT). Run side by
side, as mlx-lm's `BatchGenerator` would run all it is given, each waits for all;
worse, its batched prefill pads every prompt of a step to the longest chunk.

So prompts start in line, shortest first, and a prompt starts beside those
prefilling only if it finishes within its share of one step (a short question next
to a long context waits one step, not the whole context), and, beside prompts that
finish in that step too, only if batching it saves more than it delays them
(`join_limit`, from measured costs); or if it is shorter than
the one prompt prefilling (the two share the steps until the shorter is done: as
near to running it first as `BatchGenerator`, which gives every prompt in a step
the same chunk, allows). While streams decode, a step's prompts share its token
budget, so padding a short prompt to the others' chunk costs no more than the step
was to cost; with nothing decoding every prompt gets the largest chunk and a short
one beside a long prefill is padded to it (one step's worth, once). A prompt that
has waited `max_wait` seconds goes ahead of any shorter one (oldest first), and
nothing starts beside a running prompt while it waits: a long prompt waits at most
`max_wait` plus the prefills already running (and those of requests that waited for
a shared prefix, which start when it is cached: `admission`).

Pure policy: `choose` decides from token counts and times; the batch carries it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Waiting(Generic[R]):
    item: R
    remaining: int  # prompt tokens the cache does not hold
    arrived: float  # seconds, on the clock `now` is read from


def in_line(waiting: Sequence[Waiting[R]], now: float, max_wait: float) -> list[Waiting[R]]:
    """The order prompts start in: those waited `max_wait` first, oldest first; then
    shortest remaining first, ties in arrival order."""

    def key(w: Waiting[R]) -> tuple[int, float, float]:
        if now - w.arrived >= max_wait:
            return (0, w.arrived, 0)
        return (1, w.remaining, w.arrived)

    return sorted(waiting, key=key)


def choose(
    waiting: Sequence[Waiting[R]],
    prefilling: Sequence[int],
    budget: int,
    now: float,
    max_wait: float,
    join_limit: int | None = None,
) -> list[R]:
    """The waiting prompts to start now, in order.

    `prefilling`: tokens left of each prompt prefilling already; `budget`: prompt
    tokens one step may prefill, shared by the prompts prefilled in it; `join_limit`:
    the most tokens a prompt may have left to join others that finish in the same step
    (None: no limit), see `join_limit`.
    """
    line = in_line(waiting, now, max_wait)
    if not line:
        return []
    if prefilling and now - line[0].arrived >= max_wait:
        return []  # it goes next: nobody starts ahead of it
    chosen = [] if prefilling else [line[0]]
    for w in line[len(chosen) :]:
        # Every prompt joining beside the first must finish within its share of the step
        # (the first may be long: it has its turn; overdue ones head the line by age).
        joining = [x.remaining for x in chosen[0 if prefilling else 1 :]]
        if max([w.remaining, *joining]) > budget // (len(prefilling) + len(chosen) + 1):
            break
        together = [*prefilling, *(x.remaining for x in chosen)]
        if join_limit is not None and w.remaining > join_limit and max(together) <= budget:
            break  # they would all wait for it: it goes next, on its own
        chosen.append(w)
    if not chosen and len(prefilling) == 1 and line[0].remaining < prefilling[0]:
        chosen = [line[0]]  # shorter than the one prefilling: the two share the steps
    return [w.item for w in chosen]


def join_limit(step_seconds: float | None, per_token: float | None) -> int | None:
    """The most prompt tokens worth prefilling in a step beside others that end in it.

    Prompts prefilled in one step all get their first token when the step ends, so each
    one added delays the others by its own prefill; what it saves is a step's fixed cost
    (reading the weights once more), which a step of the running streams' decoding
    measures. Worth it only for a prompt whose prefill costs less than that. Where a
    step is mostly its fixed cost (a GPU, short prompts) this lets them batch; where
    prefill is bound by compute (a CPU) they go one after another, shortest first, and
    the first tokens come one prompt apart instead of all at the end. None until both
    costs have been measured.
    """
    if not step_seconds or not per_token:
        return None
    return int(step_seconds / per_token)
