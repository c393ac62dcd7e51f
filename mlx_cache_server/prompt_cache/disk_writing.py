"""The disk tier's writes: queued behind the RAM tier, made by one writer thread.

`DiskWriting` is a part of `DiskTier`: the writer thread runs `_write_loop`, and
what it indexes it indexes under the tier's lock; the invariants are the tier's
(`mlx_cache_server.prompt_cache.disk`).
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

from .disk_files import Segment, binding, join, write_segment
from .disk_index import SUFFIX, Row, insert
from .disk_space import DiskFile, DiskStats, namespace_of
from .disk_tree import attach, first_gap, held
from .radix import TOKEN, Node, walk

log = logging.getLogger("mlx_cache_server.prompt_cache.disk")  # the tier's one logger

# Bump when what a file holds changes meaning (2: checksums over the arrays; 3: over the
# whole file and its index row).
FORMAT = 3
HEADER_SLACK = 1024  # bytes reserved for a file's header, plus ENTRY_SLACK per array
ENTRY_SLACK = 128
MAX_PENDING = 256  # writes queued at most; more are skipped (the RAM tier still has them)

Runs = list[tuple[int, int, Segment]]  # (start, end, KV of [start, end)) along a path


class DiskWriting:
    folder: Path
    stats: DiskStats
    _lock: threading.Lock
    _closed: bool
    _abandon: bool
    _jobs: queue.Queue[tuple | None]
    _roots: dict[str, Node]
    _lru: OrderedDict[DiskFile, None]
    _epochs: dict[str, int]
    _cleared: int
    _nbytes: int
    _layout: str | None
    _db_open: bool
    _db: sqlite3.Connection
    _used: Callable[[list[DiskFile]], None]
    _make_room: Callable[[int, set[DiskFile]], bool]
    _drop: Callable[[DiskFile], int]
    _count: Callable[[], None]
    _commit_recency: Callable[[], None]

    def put(self, model: Hashable, key: bytes, path: Runs, layout: str) -> None:
        """Queue the KV of `key`'s path (its segments, in order) for writing.

        Written behind, and only what the disk lacks of the path by then.
        """
        ns = namespace_of(model)
        with self._lock:
            if self._closed or self.max_bytes == 0:
                return
            if self.stats.pending >= MAX_PENDING:
                self.stats.skipped += 1
                return
            self.stats.pending += 1
            epoch = self._epoch(ns)
        self._jobs.put((ns, epoch, bytes(key), path, layout))

    def _epoch(self, ns: str) -> tuple[int, int]:
        return self._cleared, self._epochs.get(ns, 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued so far are done; False if `timeout` passed first."""
        if self._closed:
            return True
        done = threading.Event()
        self._jobs.put(("flush", done))
        return done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "flush":
                job[1].set()
                continue
            try:
                while not self._abandon and self._write(*job):
                    pass
            except Exception:  # never fatal: the RAM tier still holds it
                log.exception("writing a cache segment to disk failed")
                with self._lock:
                    self.stats.skipped += 1
            finally:
                with self._lock:
                    self.stats.pending -= 1

    def _write(self, ns: str, epoch: tuple[int, int], key: bytes, path: Runs, layout: str) -> bool:
        """Write what the disk lacks of `key`'s path, up to its first gap; whether more
        of it (past that gap) remains to be written."""
        n = len(key) // TOKEN
        with self._lock:
            if self._epoch(ns) != epoch:
                return False  # cleared since it was queued
            root = self._roots.get(ns)
            w = walk(root, key) if root is not None else None
            have = held(w) if w is not None else 0
            if have >= n:  # already on disk: only recency changes
                self._used([node.segment for node in w.nodes])
                return False
            if self._layout is not None and layout != self._layout:
                self.stats.skipped += 1
                return False
            # A gap the path runs through is filled first, then what lies past the files
            # kept beyond it.
            gap = first_gap(w) if w is not None else None
            stop = gap.depth if gap is not None and w.length >= gap.depth else n
            pieces = [(max(s, have), min(e, stop), seg, s, e) for s, e, seg in path
                      if e > have and s < stop]  # fmt: skip
            arrays_nbytes = sum(a.nbytes * (hi - lo) // (e - s) for lo, hi, seg, s, e in pieces
                                for layer in seg for a in layer)  # fmt: skip
            count = sum(len(layer) for layer in path[0][2]) if path else 0
            reserve = arrays_nbytes + HEADER_SLACK + ENTRY_SLACK * count
            keep = {node.segment for node in w.nodes} if w is not None else set()
            if not self._make_room(reserve, keep):
                self.stats.skipped += 1
                return False
            self._nbytes += reserve
        name = uuid.uuid4().hex
        t0 = time.perf_counter()
        f, kept = None, False
        try:
            segment = join([tuple(tuple(a[..., lo - s : hi - s, :] for a in layer)
                                  for layer in seg) for lo, hi, seg, s, _ in pieces])  # fmt: skip
            meta = {"format": str(FORMAT), "start": str(have), "end": str(stop)}
            seed = binding(name, ns, have, stop, layout, key[: stop * TOKEN])
            size, digest = write_segment(self.folder, name, segment, meta, reserve, seed)
            f = DiskFile(name, ns, have, stop, size, digest, seed)
        except Exception as e:  # a full disk, a folder gone: the RAM tier still has it
            log.warning("cannot write a cache segment to disk: %s", e)
        finally:
            final = self.folder / (name + SUFFIX)
            with self._lock:
                self._nbytes -= reserve
                if f is None:
                    self.stats.skipped += 1
                elif not self._keep(f, key, epoch, layout):
                    final.unlink(missing_ok=True)
                    self.stats.skipped += 1
                else:
                    kept = True
                    self.stats.writes += 1
                    self.stats.bytes_written += f.nbytes
                    self.stats.write_seconds += time.perf_counter() - t0
                self._count()
        return kept and stop < n  # past the gap just filled, files were kept

    def _keep(self, f: DiskFile, key: bytes, epoch: tuple[int, int], layout: str) -> bool:
        """Index a written file, under the lock; False if it no longer belongs."""
        if not self._db_open or self._epoch(f.namespace) != epoch:
            return False  # cleared meanwhile
        root = self._roots.setdefault(f.namespace, Node(edge=b""))
        if attach(root, f, key) is None:  # its path's beginning was dropped meanwhile
            return False
        self._lru[f] = None
        self._nbytes += f.nbytes
        tokens = key[: f.end * TOKEN]
        try:
            insert(self._db, Row(f.name, f.namespace, f.start, f.end, tokens, f.nbytes,
                                 f.digest, layout))  # fmt: skip
            self._layout = layout
            self._used([node.segment for node in walk(root, tokens).nodes])
            self._commit_recency()
        except sqlite3.Error as e:
            log.warning("cannot index a cache segment: %s", e)
            self._drop(f)
            return False
        return True
