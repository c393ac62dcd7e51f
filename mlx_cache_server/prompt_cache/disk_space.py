"""The disk tier's files as a tree and under its budget: what a file is, which goes
first when room is short, and removing one (for room, or found bad).

Invariants (the tier's, `mlx_cache_server.prompt_cache.disk`, as far as they are kept
here): `nbytes` is the size of the files held plus the reservation of the write under
way; `make_room` and `reserve` return True only with it, and what they were asked for,
within `max_bytes`; the files are in `lru` least recently used first, a path's
beginning never older than its end; a file removed leaves the index, the folder and
the tree together.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from .disk_index import Index
from .disk_tree import prune
from .radix import Node, detach, iter_nodes


@dataclass(eq=False)
class DiskFile:
    name: str
    namespace: str
    start: int
    end: int
    nbytes: int
    digest: str
    seed: int  # its row's `disk_files.binding`, which its checksum starts from
    nodes: list[Node] = field(default_factory=list)  # tree nodes whose edge lies in it


@dataclass
class DiskStats:
    files: int = 0
    bytes: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    dropped: int = 0  # files found bad (missing, truncated, corrupt) and removed
    evicted: int = 0  # files removed for room, with the files below them
    skipped: int = 0  # writes not made: no room, a full queue, or an I/O error
    pending: int = 0


def namespace_of(model: Hashable) -> str:
    return json.dumps(model) if isinstance(model, str | tuple | list) else repr(model)


class DiskSpace:
    """The files a `DiskTier` holds, in least recently used order, under its byte budget.

    Given the tier's index (a file removed loses its row and its file) and its counters
    (`files`, `bytes` and `evicted` are kept here). Every method expects the tier's lock
    held; `lru` and `nbytes` are read by the tier and changed only here.
    """

    def __init__(self, max_bytes: int, index: Index, stats: DiskStats) -> None:
        self.max_bytes = max_bytes
        self.lru: OrderedDict[DiskFile, None] = OrderedDict()
        self.nbytes = 0  # files' sizes plus the reservation of the write under way
        self._touched: dict[str, float] = {}  # recency not yet in the index
        self._index = index
        self._stats = stats

    def hold(self, f: DiskFile) -> None:
        """Count `f` in, as the most recently used file (its nodes are hung already)."""
        self.lru[f] = None
        self.nbytes += f.nbytes

    def order_by(self, recency: dict[str, int]) -> None:
        """Put the files in the order of their names' `recency`, least recent first."""
        self.lru = OrderedDict((f, None) for f in sorted(self.lru, key=lambda f: recency[f.name]))

    def used(self, files: list[DiskFile]) -> None:
        """Files of a path just used: the path's beginning ends up the most recent, so
        eviction takes paths from their end, never their shared beginning first."""
        now = time.time()
        for f in reversed(dict.fromkeys(files)):
            if f in self.lru:
                self.lru.move_to_end(f)
                self._touched[f.name] = now

    def commit_recency(self) -> None:
        """Write the recency gathered since the last commit to the index."""
        self._index.commit_recency(self._touched)

    def make_room(self, need: int, keep: set[DiskFile]) -> bool:
        """Remove least recently used files, none of `keep`, until `need` more bytes fit;
        False (having removed some) when they cannot."""
        if need > self.max_bytes:
            return False
        while self.nbytes + need > self.max_bytes:
            victim = next((f for f in self.lru if f not in keep), None)
            if victim is None:
                return False
            self._stats.evicted += self.drop(victim)
        return True

    def reserve(self, need: int, keep: set[DiskFile]) -> bool:
        """Make room for a write of `need` bytes and count them until `release`."""
        if not self.make_room(need, keep):
            return False
        self.nbytes += need
        return True

    def release(self, reserved: int) -> None:
        self.nbytes -= reserved

    def drop(self, f: DiskFile) -> int:
        """Remove `f`, the nodes in it and everything below them; the files removed."""
        # Every file below one of f's nodes continues a path through f's tokens.
        gone = {f: None}
        for node in list(f.nodes):
            if node.parent is None:
                continue  # already cut off with an ancestor in f
            parent = node.parent
            detach(node)
            prune(parent)
            for below in iter_nodes(node):
                gone[below.held] = None
        removed = 0
        for g in gone:
            if g in self.lru:
                del self.lru[g]
                self.nbytes -= g.nbytes
                self._forget(g.name)
                removed += 1
        self.count()
        return removed

    def lose(self, f: DiskFile) -> None:
        """Remove a file found bad, leaving its tokens as gaps over the files below it:
        their KV is still right, and is served again once a write fills the gaps."""
        del self.lru[f]
        self.nbytes -= f.nbytes
        self._forget(f.name)
        for node in f.nodes:
            node.held = None
        for node in f.nodes:
            prune(node)
        self.count()

    def _forget(self, name: str) -> None:
        self._touched.pop(name, None)
        self._index.forget(name)

    def count(self) -> None:
        """Bring the counters' `files` and `bytes` up to date."""
        self._stats.files, self._stats.bytes = len(self.lru), self.nbytes
