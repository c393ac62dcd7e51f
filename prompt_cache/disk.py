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
  removed. A file whose checksum does not match on load is dropped, never served.
- `clear` wins over writes queued or under way before it: they are dropped.
- Namespaces (a model in one tenant's name) never share files.
- One lock guards the trees, the LRU order, the counters and the index; file
  writes and reads run outside it. Only the writer thread commits recency.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .disk_files import BadFile, Segment, join, read_segment, write_segment
from .disk_index import SUFFIX, Row, commit_recency, forget, insert, open_index, read_rows
from .disk_index import remove_stale as remove_stale
from .disk_tree import attach, first_gap, held, prune
from .radix import TOKEN, Node, detach, iter_nodes, walk

log = logging.getLogger(__name__)

FORMAT = 2  # bump when what a file holds changes meaning (2: checksums over the arrays)
HEADER_SLACK = 1024  # bytes reserved for a file's header, plus ENTRY_SLACK per array
ENTRY_SLACK = 128
MAX_PENDING = 256  # writes queued at most; more are skipped (the RAM tier still has them)

Runs = list[tuple[int, int, Segment]]  # (start, end, KV of [start, end)) along a path


class DiskTierBusy(RuntimeError):
    """Another process uses this cache folder for the same model."""


class DiskTierUnavailable(RuntimeError):
    """The cache folder cannot be written: read-only, full, not a folder, no permission."""


@dataclass(eq=False)
class DiskFile:
    name: str
    namespace: str
    start: int
    end: int
    nbytes: int
    digest: str
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


class DiskTier:
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
            f = DiskFile(row.name, row.namespace, row.start, row.end, row.nbytes, row.digest)
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
            return read_segment(self.folder / (f.name + SUFFIX), f.nbytes, f.digest)
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

    # -------------------------------------------------------------- writes

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
            size, digest = write_segment(self.folder, name, segment, meta, reserve)
            f = DiskFile(name, ns, have, stop, size, digest)
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

    # ------------------------------------------------------ tree and budget

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
