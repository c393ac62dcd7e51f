"""The disk tier's writes: queued behind the RAM tier, made by one writer thread.

Invariants (the tier's, `mlx_cache_server.prompt_cache.disk`, as far as they are kept
here): a file is written outside the lock under a temporary name with its bytes
reserved first, and indexed under the lock only if no clear came since its write was
queued (`cancel`) and its path's beginning is still held; every file shares `layout`.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Hashable
from pathlib import Path

from .disk_files import Segment, binding, join, write_segment
from .disk_index import SUFFIX, Index, Row
from .disk_space import DiskFile, DiskSpace, DiskStats, namespace_of
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


class DiskWriter:
    """A `DiskTier`'s writes: the queue, the one thread that drains it, and what says a
    queued write was cleared.

    Given the tier's lock (taken here to index; never held across a file's write), its
    folder, its trees (`roots`, one per namespace: a written file is hung there), its
    space (room, and the files held), its index and its counters. `layout` is the cache
    layout every file shares, as JSON: the tier's restored one, else the first written;
    read by the tier, set only here.
    """

    def __init__(
        self,
        lock: threading.Lock,
        folder: Path,
        roots: dict[str, Node],
        space: DiskSpace,
        index: Index,
        stats: DiskStats,
        layout: str | None,
    ) -> None:
        self.layout = layout
        self._lock = lock
        self._folder = folder
        self._roots = roots
        self._space = space
        self._index = index
        self._stats = stats
        self._epochs: dict[str, int] = {}  # per namespace, bumped by cancel(namespace)
        self._cleared = 0  # bumped by cancel(None)
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._closed = self._abandon = False
        self._thread = threading.Thread(target=self._write_loop, name="disk-writer", daemon=True)
        self._thread.start()

    def put(self, model: Hashable, key: bytes, path: Runs, layout: str) -> None:
        """Queue the KV of `key`'s path (its segments, in order) for writing.

        Written behind, and only what the disk lacks of the path by then.
        """
        ns = namespace_of(model)
        with self._lock:
            if self._closed or self._space.max_bytes == 0:
                return
            if self._stats.pending >= MAX_PENDING:
                self._stats.skipped += 1
                return
            self._stats.pending += 1
            epoch = self._epoch(ns)
        self._jobs.put((ns, epoch, bytes(key), path, layout))

    def cancel(self, ns: str | None) -> None:
        """Drop the writes queued or under way for namespace `ns` (for all when None): a
        clear wins over them. Expects the tier's lock held."""
        if ns is None:
            self._cleared += 1
        else:
            self._epochs[ns] = self._epochs.get(ns, 0) + 1

    def _epoch(self, ns: str) -> tuple[int, int]:
        return self._cleared, self._epochs.get(ns, 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued so far are done; False if `timeout` passed first."""
        if self._closed:
            return True
        done = threading.Event()
        self._jobs.put(("flush", done))
        return done.wait(timeout)

    def stop(self, timeout: float | None) -> bool:
        """Finish the queued writes within `timeout` and drop the rest; False when it was
        stopped already. Expects the tier's lock free.

        The write under way when time is up is waited for: stopping a thread inside MLX
        at exit aborts the process.
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abandon = True
            self._thread.join()
        return True

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
                    self._stats.skipped += 1
            finally:
                with self._lock:
                    self._stats.pending -= 1

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
                self._space.used([node.held for node in w.nodes])
                return False
            if self.layout is not None and layout != self.layout:
                self._stats.skipped += 1
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
            keep = {node.held for node in w.nodes} if w is not None else set()
            if not self._space.reserve(reserve, keep):
                self._stats.skipped += 1
                return False
        name = uuid.uuid4().hex
        t0 = time.perf_counter()
        f, kept = None, False
        try:
            segment = join([tuple(tuple(a[..., lo - s : hi - s, :] for a in layer)
                                  for layer in seg) for lo, hi, seg, s, _ in pieces])  # fmt: skip
            meta = {"format": str(FORMAT), "start": str(have), "end": str(stop)}
            seed = binding(name, ns, have, stop, layout, key[: stop * TOKEN])
            size, digest = write_segment(self._folder, name, segment, meta, reserve, seed)
            f = DiskFile(name, ns, have, stop, size, digest, seed)
        except Exception as e:  # a full disk, a folder gone: the RAM tier still has it
            log.warning("cannot write a cache segment to disk: %s", e)
        finally:
            final = self._folder / (name + SUFFIX)
            with self._lock:
                self._space.release(reserve)
                if f is None:
                    self._stats.skipped += 1
                elif not self._keep(f, key, epoch, layout):
                    final.unlink(missing_ok=True)
                    self._stats.skipped += 1
                else:
                    kept = True
                    self._stats.writes += 1
                    self._stats.bytes_written += f.nbytes
                    self._stats.write_seconds += time.perf_counter() - t0
                self._space.count()
        return kept and stop < n  # past the gap just filled, files were kept

    def _keep(self, f: DiskFile, key: bytes, epoch: tuple[int, int], layout: str) -> bool:
        """Index a written file, under the lock; False if it no longer belongs."""
        if not self._index.open or self._epoch(f.namespace) != epoch:
            return False  # cleared meanwhile
        root = self._roots.setdefault(f.namespace, Node(edge=b""))
        if attach(root, f, key) is None:  # its path's beginning was dropped meanwhile
            return False
        self._space.hold(f)
        tokens = key[: f.end * TOKEN]
        try:
            self._index.insert(Row(f.name, f.namespace, f.start, f.end, tokens, f.nbytes,
                                   f.digest, layout))  # fmt: skip
            self.layout = layout
            self._space.used([node.held for node in walk(root, tokens).nodes])
            self._space.commit_recency()
        except sqlite3.Error as e:
            log.warning("cannot index a cache segment: %s", e)
            self._space.drop(f)
            return False
        return True
