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
  each node's edge lying within one file (`node.segment` is the file): splitting
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
import queue
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable
from pathlib import Path

import mlx.core as mx

from .disk_files import BadFile, Segment, binding, join, read_segment
from .disk_index import SUFFIX, forget, open_index, read_rows
from .disk_index import remove_stale as remove_stale
from .disk_space import DiskFile, DiskSpace, DiskStats, namespace_of
from .disk_tree import attach, held
from .disk_writing import FORMAT as FORMAT
from .disk_writing import HEADER_SLACK as HEADER_SLACK
from .disk_writing import DiskWriting
from .radix import TOKEN, Node, walk

log = logging.getLogger(__name__)


class DiskTierBusy(RuntimeError):
    """Another process uses this cache folder for the same model."""


class DiskTierUnavailable(RuntimeError):
    """The cache folder cannot be written: read-only, full, not a folder, no permission."""


class DiskTier(DiskSpace, DiskWriting):
    """Segments of cached paths on disk, under a byte budget, surviving restarts."""

    def __init__(self, root: str | Path, fingerprint: str, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("the disk budget must be >= 0")
        self.max_bytes = max_bytes
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
        self._lru: OrderedDict[DiskFile, None] = OrderedDict()
        self._touched: dict[str, float] = {}  # recency not yet in the index
        self._epochs: dict[str, int] = {}  # per namespace, bumped by clear(model)
        self._cleared = 0  # bumped by clear()
        self._nbytes = 0  # files' sizes plus the reservation of the write under way
        self._layout: str | None = None  # the cache layout all files share, as JSON
        self.stats = DiskStats()
        try:
            self._db = open_index(self.folder)
            self._db_open = True
            self._restore()
        except (OSError, sqlite3.Error) as e:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            self._lockfile.close()
            raise DiskTierUnavailable(f"cannot use {self.folder}: {e}") from e
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._closed = self._abandon = False
        self._writer = threading.Thread(target=self._write_loop, name="disk-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------- restore

    def _restore(self) -> None:
        rows, bad = read_rows(self._db, self.folder)
        recency = {row.name: i for i, row in enumerate(rows)}
        known = set()
        orphans = 0
        # Parents before children: a file's run starts where its parent's path ends.
        for row in sorted(rows, key=lambda r: (r.start, r.end)):
            seed = binding(row.name, row.namespace, row.start, row.end, row.layout, row.tokens)
            f = DiskFile(row.name, row.namespace, row.start, row.end, row.nbytes, row.digest, seed)
            if self._layout not in (None, row.layout):
                bad.append((row.name, "it was written for another cache layout"))
                continue
            root = self._roots.setdefault(f.namespace, Node(edge=b""))
            node = attach(root, f, row.tokens, gap_ok=True)
            if node is None:
                bad.append((row.name, "it overlaps another file"))
                continue
            orphans += held(walk(root, row.tokens)) < f.start
            self._layout = row.layout
            known.add(row.name)
            self._lru[f] = None
            self._nbytes += f.nbytes
        for name, why in bad:
            forget(self._db, self.folder, name)
            log.debug("dropping cache file %s: %s", name, why)
        self.stats.dropped += len(bad)
        self._lru = OrderedDict((f, None) for f in sorted(self._lru, key=lambda f: recency[f.name]))
        for path in self.folder.iterdir():  # temporary files, files of rows gone
            if path.name.endswith(SUFFIX) and path.name.removesuffix(SUFFIX) not in known:
                path.unlink(missing_ok=True)
        self._make_room(0, set())  # a smaller budget than the last process had
        self._db.commit()
        self._count()
        if bad or orphans:
            reasons = Counter(why.split(" (")[0] for _, why in bad)
            log.warning(
                "disk cache %s: %d files restored, %d dropped%s%s", self.folder, len(known),
                len(bad), f" ({', '.join(f'{r}: {n}' for r, n in reasons.items())})" if bad else "",
                f"; {orphans} kept behind a lost file, usable again once a request through it "
                "is stored" if orphans else "",
            )  # fmt: skip

    # --------------------------------------------------------------- reads

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def layout(self) -> str | None:
        return self._layout

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
                f = node.segment
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
                f = node.segment
                lo, hi = max(start, node.start), min(end, node.depth)
                if lo >= hi:
                    continue
                if files and files[-1][0] is f:
                    files[-1][2] = hi
                else:
                    files.append([f, lo, hi])
            self._used([node.segment for node in w.nodes])
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
            return read_segment(path, f.nbytes, f.digest, f.seed, self._layout or "[]",
                                f.end - f.start)  # fmt: skip
        except BadFile as e:
            return self._bad(f, str(e))

    def _bad(self, f: DiskFile, why: str) -> None:
        log.warning("dropping cache file %s: it %s", f.name, why)
        with self._lock:
            if f in self._lru and self._db_open:
                self._lose(f)
                self.stats.dropped += 1
                self._db.commit()
        return None

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued writes within `timeout`, drop the rest, and release the folder.

        The write under way when time is up is waited for: stopping a thread inside MLX
        at exit aborts the process.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            self._abandon = True
            self._writer.join()
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._commit_recency()
            self._db.close()
            self._db_open = False
        self._lockfile.close()

    def clear(self, model: Hashable | None = None) -> None:
        """Remove the files of `model` (of every model when None), and drop the writes
        queued or under way for it."""
        with self._lock:
            if not self._db_open:
                return
            ns = None if model is None else namespace_of(model)
            if ns is None:
                self._cleared += 1
            else:
                self._epochs[ns] = self._epochs.get(ns, 0) + 1
            for f in [f for f in self._lru if ns is None or f.namespace == ns]:
                if f in self._lru:
                    self._drop(f)
            for name in [ns] if ns is not None else list(self._roots):
                root = self._roots.get(name)
                if root is not None and not root.children:
                    del self._roots[name]
            with contextlib.suppress(sqlite3.Error):
                self._db.commit()
