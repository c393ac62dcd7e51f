"""What a fetch will build and what an insert copies, decided from a walk of the tree.

Pure functions over `radix` nodes: the manager calls them under its lock (plans) or
outside it (copies), and applies what they return.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from . import checkpoints, layers
from .held import Entry
from .layers import Layout
from .radix import Node, Walk, nearest

Kind = Literal["exact", "shorter", "longer", "miss"]


@dataclass
class Plan:
    """What a fetch will build, decided under the lock and built outside it."""

    kind: Kind
    n: int
    pinned: list[Node]
    used: Node | None  # the cached sequence's node this fetch counts as a use of
    pieces: list[tuple[layers.Segment, int]] = field(default_factory=list)
    entry: list[Any] | None = None
    trim: int = 0
    saved: list[Any] | None = None  # checkpointed mode: the recurrent layers' state at `n`
    windows: list[tuple[layers.Segment, int, int]] | None = None  # window KV before `n`


def plan_segments(w: Walk, asked: int) -> Plan | None:
    n = min(w.length, asked - 1)
    if n <= 0:
        return None
    pinned, pieces = [], []
    for node in w.nodes:
        if node.start >= n:
            break
        pinned.append(node)
        pieces.append((node.held.segment, min(node.depth, n) - node.start))
    end = w.nodes[-1]
    if end.terminal and w.length == end.depth:
        kind: Kind = "exact" if w.length == asked else "shorter"
    else:
        kind = "longer"
    # The reused tokens belong to one cached sequence alone when no branch
    # follows: that sequence counts as used.
    used = end
    while not used.terminal and len(used.children) == 1:
        (used,) = used.children.values()
    return Plan(kind, n, pinned, used, pieces=pieces)


def plan_checkpointed(layout: Layout, w: Walk, asked: int) -> Plan | None:
    n, resumed = checkpoints.resume_point(w, asked, layout.span, bool(layout.states))
    if n <= 0:
        return None
    plan = plan_segments(w, n + 1)  # the KV layers' pieces up to `n`, kind and use as there
    plan.n = n
    plan.saved = resumed.held.checkpoint if resumed is not None else None
    plan.windows = checkpoints.window_pieces(w.nodes, n, layout.span)
    end = w.nodes[-1]
    if end.terminal and w.length == end.depth:
        plan.kind = "exact" if w.length == asked else "shorter"
    return plan


def plan_snapshot(w: Walk, asked: int) -> Plan | None:
    limit = asked - 1
    best: Plan | None = None
    for node in reversed(w.nodes):
        if not node.terminal or node.depth > w.length:
            continue
        entry = node.held
        if node.depth <= limit:
            best = Plan("shorter", node.depth, [node], node, entry=entry.cache)
            break
        if entry.trimmable:  # the exact sequence, trimmed by its last token
            best = Plan("exact", limit, [node], node, entry=entry.cache, trim=node.depth - limit)
            break
    n = min(w.length, limit)
    if w.nodes and n > (best.n if best else 0):
        longer = nearest(w.nodes[-1], lambda x: x.terminal and x.depth > n and x.held.trimmable)
        if longer is not None:
            best = Plan("longer", n, [longer], longer, entry=longer.held.cache,
                        trim=longer.depth - n)  # fmt: skip
    return best


@dataclass
class Prepared:
    """Copies made outside the lock for an insert."""

    start: int = 0
    segment: layers.Segment | None = None
    split_of: Any = None
    split_at: int = 0
    halves: tuple[layers.Segment, layers.Segment] | None = None
    entry: Entry | None = None  # snapshot mode: the whole sequence's cache
    checkpoint: list[Any] | None = None
    checkpoint_nbytes: int = 0
    window: layers.Segment | None = None  # the window layers' KV of tokens [window_from, n)
    window_from: int = 0


def prepare_insert(
    layout: Layout, w: Walk, n: int, cache: list[Any], measure: Callable[[Any], int]
) -> Prepared:
    if layout.checkpointed:
        prep = prepare_segment(layout.by_prefix, w, n, layers.kv_part(layout, cache), True)
        prep.checkpoint = layers.checkpoint(layout, cache)
        prep.checkpoint_nbytes = measure(prep.checkpoint) if prep.checkpoint is not None else 0
        if layout.windows:
            prep.window_from = window_from(layout, w, n, layers.window_held(layout, cache))
            prep.window = layers.window_segment(layout, cache, prep.window_from, n)
        return prep
    if not layout.sliceable:
        entry = layers.snapshot(cache)
        return Prepared(entry=Entry(entry, measure(entry), layers.can_trim(entry)))
    return prepare_segment(layout, w, n, cache)


def window_from(layout: Layout, w: Walk, n: int, held: int) -> int:
    """The first token whose window KV an insert of `n` tokens copies: of those its windows
    still hold, the new edge's, and what the path above lacks. With recurrent layers only
    the window before `n` is worth keeping: they resume nowhere else."""
    first = n - min(n, held if not layout.states else min(held, layout.span))
    copy = max(first, w.length)
    for node in w.nodes:
        lo, hi = max(node.start, first), min(node.depth, w.length)
        if lo < hi and node.depth - node.held.window_held > lo:  # it lacks some of [lo, hi)
            copy = min(copy, lo)
    return copy


def prepare_segment(
    layout: Layout, w: Walk, n: int, kv: list[Any], always_split: bool = False
) -> Prepared:
    """The segment of tokens [w.length, n) of the KV layers `kv` (of the sliceable `layout`),
    and the halves of the edge the walk stopped in (`always_split`: also when the sequence
    ends there)."""
    prep = Prepared(start=w.length)
    if w.length < n:
        prep.segment = layers.slice_segment(layout, kv, w.length, n)
    if w.partial and (w.length < n or always_split):
        end = w.nodes[-1]
        prep.split_of, prep.split_at = end.held.segment, w.length - end.start
        prep.halves = (
            layers.cut_segment(end.held.segment, 0, prep.split_at),
            layers.cut_segment(end.held.segment, prep.split_at),
        )
    return prep
