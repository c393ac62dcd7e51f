"""What each step of the engine acts on, read in one place.

A step's inputs are what comes from outside the engine thread: the requests that
arrived, the ones their clients gave up, the time, the cost the last step measured,
a flush of the cache, an idle pause's memory release. Everything the batch and the
prompt cache decide (who starts, how large a chunk, what the cache matches, keeps and
evicts) follows from these and from their own state. So a server sharded over several
processes (`mlx.launch`) stays in step by reading the inputs once, on rank 0, and
handing every rank the same ones (`sharded_steps.LeaderSteps`,
`sharded_steps.FollowerSteps`); one process reads its own (`LocalSteps`).

Invariants: a request appears in `new` once, and in `cancelled` at most once, in that
step or a later one; the engine thread sets `Request.cancelled` only from `cancelled`,
never from the client's `cancel()`, so a cancellation takes effect at the same step
on every rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .request import Request

IDLE_WAIT = 0.1  # seconds an idle engine waits for a request before looking around


@dataclass(frozen=True)
class Measured:
    """One step's cost, as the batch's `StepCosts` takes it."""

    seconds: float
    prompt_tokens: int
    decoded: bool
    depth: float = 0.0  # where the step's prompt tokens stand in their prompts (`Batch`)


@dataclass
class StepInputs:
    now: float
    new: list[Request] = field(default_factory=list)
    cancelled: list[Request] = field(default_factory=list)
    measured: Measured | None = None  # the previous step's
    flush: bool = False  # empty the prompt cache before this step
    release: bool = False  # hand pooled memory back to the system (an idle pause)
    stop: bool = False  # the engine is stopping: this step is not run

    @property
    def empty(self) -> bool:
        """Nothing for the engine to act on (nor for another rank to be told)."""
        return not (
            self.new or self.cancelled or self.measured or self.flush or self.release or self.stop
        )


class StepSource(Protocol):
    def next(self, busy: bool) -> StepInputs:
        """The next step's inputs; while the engine is idle (not `busy`), waits a little
        for a request first."""
        ...

    def measured(self, cost: Measured | None) -> None:
        """The cost of the step just run, for the next step's inputs."""
        ...


class LocalSteps:
    """The inputs of one process's engine: its inbox, its clients' cancellations, its clock."""

    def __init__(self, inbox: queue.Queue[Request | None], clock: Callable[[], float]) -> None:
        self.inbox, self.clock = inbox, clock
        self.stopping = threading.Event()
        self.flush_asked = threading.Event()
        self.release_asked = threading.Event()  # sharded: every rank releases at one step
        self._live: dict[int, Request] = {}  # taken and not ended: whose cancellation to watch
        self._cost: Measured | None = None

    def next(self, busy: bool) -> StepInputs:
        new = self._take(block=not busy)
        self._live.update((r.rid, r) for r in new)
        for rid in [rid for rid, r in self._live.items() if r.ended]:
            del self._live[rid]
        cancelled = [r for r in self._live.values() if r.cancel_asked and not r.cancelled]
        flush, release = _take_flag(self.flush_asked), _take_flag(self.release_asked)
        measured, self._cost = self._cost, None
        stop = self.stopping.is_set()
        return StepInputs(self.clock(), new, cancelled, measured, flush, release, stop)

    def measured(self, cost: Measured | None) -> None:
        self._cost = cost

    def live(self) -> list[Request]:
        """Requests taken and not ended (for ending them when the engine cannot)."""
        return [r for r in list(self._live.values()) if not r.ended]

    def leftovers(self) -> list[Request]:
        """Requests taken from the inbox once the engine has stopped stepping."""
        return self._take(block=False)

    def _take(self, block: bool) -> list[Request]:
        taken: list[Request | None] = []
        try:
            if block:
                taken.append(self.inbox.get(timeout=IDLE_WAIT))
            while True:
                taken.append(self.inbox.get_nowait())
        except queue.Empty:
            return [request for request in taken if request is not None]


def _take_flag(flag: threading.Event) -> bool:
    """Whether `flag` was set; cleared only then, so a setting that lands meanwhile stays."""
    if not flag.is_set():
        return False
    flag.clear()
    return True
