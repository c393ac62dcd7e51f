"""A model's radix tree in the cache, and the counters it keeps.

The manager holds one `ModelTree` per model key (a model in a tenant's namespace);
its `stats` outlive the tree (`PromptCache.clear` drops the tree, not the counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .held import Edge, HybridEdge
from .layers import Layout, Segment
from .radix import Node


@dataclass
class CacheStats:
    lookups: int = 0
    exact: int = 0
    shorter: int = 0
    longer: int = 0
    misses: int = 0
    tokens_asked: int = 0
    tokens_reused: int = 0
    inserts: int = 0
    rejected: int = 0
    evictions: int = 0
    shortened: int = 0  # sequences whose end was cut off to make room, instead of evicted
    disk_hits: int = 0  # fetches that loaded part of their prompt's KV from the disk tier
    tokens_from_disk: int = 0
    sequences: int = 0
    bytes: int = 0

    def __iadd__(self, other: CacheStats) -> CacheStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @property
    def reuse(self) -> float:
        """Share of asked tokens that came from the cache."""
        return self.tokens_reused / self.tokens_asked if self.tokens_asked else 0.0


@dataclass(eq=False)
class ModelTree:
    """One model's tree; `version` lets an insert that copied outside the lock see whether
    the shape it walked changed meanwhile."""

    layout: Layout
    stats: CacheStats  # the model's counters, which outlive its tree (see clear)
    root: Node = field(default_factory=lambda: Node(edge=b""))
    version: int = 0  # bumped by every change to the tree's shape

    def edge(self, segment: Segment, nbytes: int) -> Edge:
        """What a new edge of this (segmented) tree holds: its KV `segment` of `nbytes`, with
        room for window KV and a checkpoint when the model is hybrid."""
        return HybridEdge(segment, nbytes) if self.layout.checkpointed else Edge(segment, nbytes)
