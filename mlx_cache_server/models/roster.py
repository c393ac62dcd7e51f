"""The loaded models, and the requests that hold or wait for each: what makes one busy.

`Roster` is the state `ModelPool` and its `Lifecycle` share, on the event loop: the pool
leases and looks up models in it, the lifecycle adds and removes them. Both are handed
the same roster; neither keeps a copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .residency import Resident
from .specs import ModelSpec

S = TypeVar("S")


@dataclass(eq=False)
class Loaded(Generic[S]):
    spec: ModelSpec
    served: S
    bytes: int
    last_used: float
    leases: int = 0  # requests between asking for the model and their slot in its engine


class Roster(Generic[S]):
    def __init__(self, requests: Callable[[S], int]) -> None:
        """`requests(served)`: the requests running or queued on a loaded model."""
        self._requests = requests
        self.loaded: dict[str, Loaded[S]] = {}  # by model id
        self.wanted: Counter[str] = Counter()  # requests waiting in `use` for a model

    def busy(self, loaded: Loaded[S]) -> bool:
        """A request holds it (`ModelPool.use`), waits for it, or still runs on it."""
        return (
            loaded.leases > 0
            or self.wanted[loaded.spec.id] > 0
            or self._requests(loaded.served) > 0
        )

    def residents(self) -> list[Resident]:
        """The loaded models as `residency`'s policy sees them."""
        return [
            Resident(m.spec.id, m.bytes, m.last_used, self.busy(m), m.spec.pinned, m.spec.ttl)
            for m in self.loaded.values()
        ]
