"""A disk tier under the prompt cache: KV segments in safetensors files, indexed in SQLite.

What the RAM tree stores is written here too, behind it, by one writer thread:
each write is the KV of the tokens a sequence adds to what the disk already holds
of its path, so a shared prefix is on disk once, as in RAM. A fetch whose prompt
goes further on disk than in RAM loads the difference back (`PromptCache` does
that). The index survives the process: a restart finds what the last one wrote.

On disk, under `root/<fingerprint>/`: `index.sqlite` with one row per file, the
files, `<name>.safetensors`, and a lock file that one process at a time holds. The
fingerprint names everything that makes KV valid (model weights, dtype, cache
layout, versions): another model never finds these files. Another fingerprint's
folder that no process holds and that was not written for a week is removed when a
tier opens (`remove_stale`): a model or version long out of use.

Invariants:
- A file holds the KV of tokens [start, end) of one path, whose tokens [0, end) its
  row records. In memory the files form a radix tree per namespace (`radix.Node`),
  each node's edge lying within one file (`node.held` is the file): splitting
  a node splits a range, never a file. A file is reachable only while the files
  before it on its path are; dropping a file drops the nodes below it, and the
  files only they used.
- Bytes are file sizes, counted from before a file is written (its arrays plus a
  bound on its header, settled to its real size after): the count never exceeds
  `max_bytes`. Room is made by dropping least recently used files; a path's
  beginning is never older than its end, so its last file goes first.
- A file is written under a temporary name and renamed, then its row committed;
  on open, rows without a file of the recorded size and files without a row are
  removed. A file's checksum covers all its bytes and the facts of its row that decide
  what it is served as (`disk_files.binding`): a file that does not match it, or does
  not parse as what the layout stores, is dropped on load, never served.
- `clear` wins over writes queued or under way before it: they are dropped.
- Namespaces (a model in one tenant's name) never share files.
- One lock guards the trees, the LRU order, the counters and the index; file
  writes and reads run outside it. Only the writer thread commits recency.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Hashable
from pathlib import Path

import mlx.core as mx

from .disk_files import BadFile, Segment, binding, join, read_segment
from .disk_index import SUFFIX, Index
from .disk_index import remove_stale as remove_stale
from .disk_space import DiskFile, DiskSpace, DiskStats, namespace_of
from .disk_tree import attach, held
from .disk_writing import FORMAT as FORMAT
from .disk_writing import HEADER_SLACK as HEADER_SLACK
from .disk_writing import DiskWriter, Runs
from .radix import TOKEN, Node, walk

log = logging.getLogger(__name__)


class DiskTierBusy(RuntimeError):
    """Another process uses this cache folder for the same model."""


class DiskTierUnavailable(RuntimeError):
    """The cache folder cannot be written: read-only, full, not a folder, no permission."""


class DiskTier:
    """Segments of cached paths on disk, under a byte budget, surviving restarts.

    It owns the folder and its lock file, the lock, the trees (`_roots`, one per
    namespace) and the counters, and hands them to its parts: the index (the SQLite
    rows), the space (the files held, under the budget) and the writer (the queue and
    its thread). Public methods take the lock themselves; the parts' methods expect it
    held, but the writer's `put`, `flush` and `stop`, which take it (or need none).
    """

    def __init__(self, root: str | Path, fingerprint: str, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("the disk budget must be >= 0")
        self.folder = Path(root) / fingerprint
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.folder, 0o700)
            self._lockfile = open(self.folder / "lock", "w")  # noqa: SIM115 (held until close)
        except OSError as e:
            raise DiskTierUnavailable(f"cannot write to {self.folder}: {e}") from e
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lockfile.close()
            raise DiskTierBusy(f"another process uses {self.folder}") from None
        self.removed_stale = remove_stale(Path(root), keep=self.folder)
        self._lock = threading.Lock()
        self._roots: dict[str, Node] = {}
        self.stats = DiskStats()
        index = None
        try:
            index = Index(self.folder)
            space = DiskSpace(max_bytes, index, self.stats)
            layout = self._restore(index, space)
        except (OSError, sqlite3.Error) as e:
            if index is not None:
                index.close()
            self._lockfile.close()
            raise DiskTierUnavailable(f"cannot use {self.folder}: {e}") from e
        self._index, self._space = index, space
        self._writer = DiskWriter(self._lock, self.folder, self._roots, space, index, self.stats,
                                  layout)  # fmt: skip

    # ------------------------------------------------------------- restore

    def _restore(self, index: Index, space: DiskSpace) -> str | None:
        """Hang the files the index holds in the trees and count them into `space`, in
        their recency order, dropping what is bad; the layout they share. Runs before any
        other thread can see the tier, so without the lock."""
        rows, bad = index.rows()
        recency = {row.name: i for i, row in enumerate(rows)}
        known = set()
        orphans = 0
        layout = None
        # Parents before children: a file's run starts where its parent's path ends.
        for row in sorted(rows, key=lambda r: (r.start, r.end)):
            seed = binding(row.name, row.namespace, row.start, row.end, row.layout, row.tokens)
            f = DiskFile(row.name, row.namespace, row.start, row.end, row.nbytes, row.digest, seed)
            if layout not in (None, row.layout):
                bad.append((row.name, "it was written for another cache layout"))
                continue
            root = self._roots.setdefault(f.namespace, Node(edge=b""))
            node = attach(root, f, row.tokens, gap_ok=True)
            if node is None:
                bad.append((row.name, "it overlaps another file"))
                continue
            orphans += held(walk(root, row.tokens)) < f.start
            layout = row.layout
            known.add(row.name)
            space.hold(f)
        for name, why in bad:
            index.forget(name)
            log.debug("dropping cache file %s: %s", name, why)
        self.stats.dropped += len(bad)
        space.order_by(recency)
        for path in self.folder.iterdir():  # temporary files, files of rows gone
            if path.name.endswith(SUFFIX) and path.name.removesuffix(SUFFIX) not in known:
                path.unlink(missing_ok=True)
        space.make_room(0, set())  # a smaller budget than the last process had
        index.commit()
        space.count()
        if bad or orphans:
            reasons = Counter(why.split(" (")[0] for _, why in bad)
            log.warning(
                "disk cache %s: %d files restored, %d dropped%s%s", self.folder, len(known),
                len(bad), f" ({', '.join(f'{r}: {n}' for r, n in reasons.items())})" if bad else "",
                f"; {orphans} kept behind a lost file, usable again once a request through it "
                "is stored" if orphans else "",
            )  # fmt: skip
        return layout

    # --------------------------------------------------------------- reads

    @property
    def nbytes(self) -> int:
        return self._space.nbytes

    @property
    def max_bytes(self) -> int:
        """The byte budget; a new one holds from the next write on."""
        return self._space.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._space.max_bytes = value

    @property
    def layout(self) -> str | None:
        """The cache layout every file shares, as JSON; None before the first."""
        return self._writer.layout

    def match(self, model: Hashable, key: bytes) -> int:
        """How many tokens of `key` (packed) the disk holds the KV of."""
        with self._lock:
            root = self._roots.get(namespace_of(model))
            return held(walk(root, key)) if root is not None else 0

    def span_bytes(self, model: Hashable, key: bytes, start: int, end: int) -> int:
        """About the bytes the KV of tokens [start, end) of `key` takes once loaded."""
        with self._lock:
            root = self._roots.get(namespace_of(model))
            nodes = walk(root, key[: end * TOKEN]).nodes if root is not None else []
            total = 0
            for node in nodes:
                f = node.held
                span = min(end, node.depth) - max(start, node.start)
                if f is not None:
                    total += max(0, span) * f.nbytes // (f.end - f.start)
            return total

    def load(self, model: Hashable, key: bytes, start: int, end: int) -> Segment | None:
        """The KV of tokens [start, end) of `key`'s path, read and verified; None if the
        disk no longer holds them all or a file is bad (then it is dropped)."""
        t0 = time.perf_counter()
        with self._lock:
            root = self._roots.get(namespace_of(model))
            w = walk(root, key[: end * TOKEN]) if root is not None else None
            if w is None or held(w) < end:
                return None
            files: list[list] = []
            for node in w.nodes:
                f = node.held
                lo, hi = max(start, node.start), min(end, node.depth)
                if lo >= hi:
                    continue
                if files and files[-1][0] is f:
                    files[-1][2] = hi
                else:
                    files.append([f, lo, hi])
            self._space.used([node.held for node in w.nodes])
        pieces = []
        for f, lo, hi in files:
            arrays = self._read(f)
            if arrays is None:
                return None
            whole = lo == f.start and hi == f.end
            # Part of a file is copied out: a view would keep the whole file's buffer.
            cut = (lambda a: a) if whole else mx.contiguous
            pieces.append(
                tuple(tuple(cut(a[..., lo - f.start : hi - f.start, :]) for a in layer)
                      for layer in arrays)
            )  # fmt: skip
        segment = join(pieces)
        mx.eval(segment)
        with self._lock:
            self.stats.tokens_loaded += end - start
            self.stats.bytes_loaded += sum(f.nbytes for f, _, _ in files)
            self.stats.load_seconds += time.perf_counter() - t0
        return segment

    def _read(self, f: DiskFile) -> list[list[mx.array]] | None:
        try:
            path = self.folder / (f.name + SUFFIX)
            return read_segment(path, f.nbytes, f.digest, f.seed, self._writer.layout or "[]",
                                f.end - f.start)  # fmt: skip
        except BadFile as e:
            return self._bad(f, str(e))

    def _bad(self, f: DiskFile, why: str) -> None:
        log.warning("dropping cache file %s: it %s", f.name, why)
        with self._lock:
            if f in self._space.lru and self._index.open:
                self._space.lose(f)
                self.stats.dropped += 1
                self._index.commit()
        return None

    # -------------------------------------------------------------- writes

    def put(self, model: Hashable, key: bytes, path: Runs, layout: str) -> None:
        """Queue the KV of `key`'s path (its segments, in order) for writing.

        Written behind, and only what the disk lacks of the path by then.
        """
        self._writer.put(model, key, path, layout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued so far are done; False if `timeout` passed first."""
        return self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued writes within `timeout`, drop the rest, and release the folder.

        The write under way when time is up is waited for: stopping a thread inside MLX
        at exit aborts the process.
        """
        if not self._writer.stop(timeout):
            return
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._space.commit_recency()
            self._index.close()
        self._lockfile.close()

    def clear(self, model: Hashable | None = None) -> None:
        """Remove the files of `model` (of every model when None), and drop the writes
        queued or under way for it."""
        with self._lock:
            if not self._index.open:
                return
            ns = None if model is None else namespace_of(model)
            self._writer.cancel(ns)
            for f in [f for f in self._space.lru if ns is None or f.namespace == ns]:
                if f in self._space.lru:
                    self._space.drop(f)
            for name in [ns] if ns is not None else list(self._roots):
                root = self._roots.get(name)
                if root is not None and not root.children:
                    del self._roots[name]
            with contextlib.suppress(sqlite3.Error):
                self._index.commit()
