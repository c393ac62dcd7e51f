"""Which loaded models to unload: for room under the memory budget, or for being idle.

Pure policy over plain records, unit-tested alone; `ModelPool` carries it out.

Invariants of every answer:
- a busy model (a request running or about to) is never chosen;
- a pinned model is never chosen;
- models go least recently used first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """A loaded model as the policy sees it."""

    id: str
    bytes: int  # what it counts against the budget: weights, cache budget, working memory
    last_used: float  # clock time it was last busy
    busy: bool
    pinned: bool = False
    ttl: float | None = None


@dataclass(frozen=True)
class Room:
    """The answer for a model about to load: unload `unload`, or wait, or give up."""

    unload: list[str]
    fits: bool  # True: after unloading `unload` it fits now
    ever: bool  # False: it cannot fit even with every unpinned model unloaded


def make_room(residents: list[Resident], need: int, budget: int | None) -> Room:
    """Least recently used idle models to unload so that `need` more bytes fit.

    Not `fits` but `ever`: busy models hold the room; wait for them to finish.
    """
    if budget is None:
        return Room([], True, True)
    pinned = sum(r.bytes for r in residents if r.pinned)
    if pinned + need > budget:
        return Room([], False, False)
    free = budget - sum(r.bytes for r in residents)
    unload = []
    for r in sorted(residents, key=lambda r: r.last_used):
        if free >= need:
            break
        if not r.busy and not r.pinned:
            unload.append(r.id)
            free += r.bytes
    fits = free >= need
    return Room(unload if fits else [], fits, True)


def expired(residents: list[Resident], now: float) -> list[str]:
    """Idle models whose ttl has run out since they were last used."""
    return [
        r.id
        for r in sorted(residents, key=lambda r: r.last_used)
        if r.ttl is not None and not r.busy and not r.pinned and now - r.last_used >= r.ttl
    ]
