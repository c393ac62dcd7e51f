"""The disk tier's files as a tree and under its budget: what a file is, which goes
first when room is short, and removing one (for room, or found bad).

`DiskSpace` is a part of `DiskTier` (its methods run under the tier's lock); the
invariants are the tier's (`mlx_cache_server.prompt_cache.disk`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

from .disk_index import commit_recency, forget
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
    max_bytes: int
    folder: Path
    stats: DiskStats
    _lru: OrderedDict[DiskFile, None]
    _touched: dict[str, float]
    _nbytes: int
    _db: sqlite3.Connection

    def _used(self, files: list[DiskFile]) -> None:
        """Files of a path just used: the path's beginning ends up the most recent, so
        eviction takes paths from their end, never their shared beginning first."""
        now = time.time()
        for f in reversed(dict.fromkeys(files)):
            if f in self._lru:
                self._lru.move_to_end(f)
                self._touched[f.name] = now

    def _commit_recency(self) -> None:
        commit_recency(self._db, self._touched)

    def _make_room(self, need: int, keep: set[DiskFile]) -> bool:
        if need > self.max_bytes:
            return False
        while self._nbytes + need > self.max_bytes:
            victim = next((f for f in self._lru if f not in keep), None)
            if victim is None:
                return False
            self.stats.evicted += self._drop(victim)
        return True

    def _drop(self, f: DiskFile) -> int:
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
                gone[below.segment] = None
        removed = 0
        for g in gone:
            if g in self._lru:
                del self._lru[g]
                self._nbytes -= g.nbytes
                self._forget(g.name)
                removed += 1
        self._count()
        return removed

    def _lose(self, f: DiskFile) -> None:
        """Remove a file found bad, leaving its tokens as gaps over the files below it:
        their KV is still right, and is served again once a write fills the gaps."""
        del self._lru[f]
        self._nbytes -= f.nbytes
        self._forget(f.name)
        for node in f.nodes:
            node.segment = None
        for node in f.nodes:
            prune(node)
        self._count()

    def _forget(self, name: str) -> None:
        self._touched.pop(name, None)
        forget(self._db, self.folder, name)

    def _count(self) -> None:
        self.stats.files, self.stats.bytes = len(self._lru), self._nbytes
