"""A disk tier under the prompt cache: KV segments in safetensors files, indexed in SQLite.

What the RAM tree stores is written here too, behind it, by one writer thread:
each write is the KV of the tokens a sequence adds to what the disk already holds
of its path, so a shared prefix is on disk once, as in RAM. A fetch whose prompt
goes further on disk than in RAM loads the difference back (`PromptCache` does
that). The index survives the process: a restart finds what the last one wrote.

On disk, under `root/<fingerprint>/`: `index.sqlite` with one row per file, and
the files, `<name>.safetensors`. The fingerprint names everything that makes KV
valid (model weights, dtype, cache layout, versions): another model never finds
these files.

Invariants:
- A file holds the KV of tokens [start, end) of one path, whose tokens [0, end) its
  row records. In memory the files form a radix tree per namespace (`radix.Node`),
  each node's edge lying within one file (`node.segment` is the file): splitting
  a node splits a range, never a file. A file is reachable only while the files
  before it on its path are; dropping a file drops the nodes below it, and the
  files only they used.
- Bytes are file sizes, counted from before a file is written (its arrays plus a
  bound on its header, settled to its real size after): the count never exceeds
  `max_bytes`. Room is made by dropping least recently used files.
- A file is written under a temporary name and renamed, then its row committed;
  on open, rows without a file of the recorded size and files without a row are
  removed. A file whose checksum does not match on load is dropped, never served.
- Namespaces (a model in one tenant's name) never share files.
- One lock guards the trees, the LRU order, the counters and the index; file
  writes and reads run outside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import sqlite3
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .radix import TOKEN, Node, add_child, detach, iter_nodes, split, walk

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a file holds changes meaning
HEADER_SLACK = 1024  # bytes reserved for a file's header, plus ENTRY_SLACK per array
ENTRY_SLACK = 128
SUFFIX = ".safetensors"

Segment = tuple[tuple[mx.array, ...], ...]


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
    hits: int = 0  # fetches that loaded tokens from disk
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    dropped: int = 0  # files found bad (missing, truncated, corrupt) and removed
    evicted: int = 0
    skipped: int = 0  # writes not made: no room, a gap in the path, or an I/O error
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
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self._lock = threading.Lock()
        self._roots: dict[str, Node] = {}
        self._lru: OrderedDict[DiskFile, None] = OrderedDict()
        self._nbytes = 0  # files' sizes plus the reservation of the write under way
        self._layout: str | None = None  # the cache layout all files share, as JSON
        self.stats = DiskStats()
        self._db = sqlite3.connect(self.folder / "index.sqlite", check_same_thread=False)
        self._db_open = True
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS files (name TEXT PRIMARY KEY, namespace TEXT, "
            "start INTEGER, end_ INTEGER, tokens BLOB, nbytes INTEGER, digest TEXT, "
            "layout TEXT, used REAL)"
        )
        self._db.commit()
        self._restore()
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="disk-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------- restore

    def _restore(self) -> None:
        rows = self._db.execute(
            "SELECT name, namespace, start, end_, tokens, nbytes, digest, layout FROM files "
            "ORDER BY used"
        ).fetchall()
        recency = {row[0]: i for i, row in enumerate(rows)}
        known = set()
        # Parents before children: a file's run starts where its parent's path ends.
        for name, ns, start, end, tokens, nbytes, digest, layout in sorted(
            rows, key=lambda r: (r[2], r[3])
        ):
            path = self.folder / (name + SUFFIX)
            ok = path.is_file() and path.stat().st_size == nbytes and len(tokens) == end * TOKEN
            if ok and self._layout not in (None, layout):
                ok = False  # cannot happen under one fingerprint; never trusted
            f = DiskFile(name, ns, start, end, nbytes, digest)
            if ok and self._attach(f, tokens) is not None:
                self._layout = layout
                known.add(name)
                self._lru[f] = None
                self._nbytes += nbytes
            else:
                self._forget(name)
                self.stats.dropped += 1
        self._lru = OrderedDict((f, None) for f in sorted(self._lru, key=lambda f: recency[f.name]))
        for path in self.folder.iterdir():  # temporary files, files of rows gone
            if path.name.endswith(SUFFIX) and path.name.removesuffix(SUFFIX) not in known:
                with contextlib.suppress(OSError):
                    path.unlink()
        self._db.commit()
        self.stats.files, self.stats.bytes = len(self._lru), self._nbytes

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
            return walk(root, key).length if root is not None else 0

    def load(self, model: Hashable, key: bytes, start: int, end: int) -> Segment | None:
        """The KV of tokens [start, end) of `key`'s path, read and verified; None if the
        disk no longer holds them all or a file is bad (then it is dropped)."""
        t0 = time.perf_counter()
        with self._lock:
            root = self._roots.get(namespace_of(model))
            w = walk(root, key[: end * TOKEN]) if root is not None else None
            if w is None or w.length < end:
                return None
            files = []
            for node in w.nodes:
                f = node.segment
                lo, hi = max(start, node.start), min(end, node.depth)
                if lo >= hi:
                    continue
                if files and files[-1][0] is f:
                    files[-1][2] = hi
                else:
                    files.append([f, lo, hi])
            self._used({node.segment: None for node in w.nodes})
        pieces = []
        for f, lo, hi in files:
            arrays = self._read(f)
            if arrays is None:
                return None
            pieces.append(
                tuple(
                    tuple(a[..., lo - f.start : hi - f.start, :] for a in layer) for layer in arrays
                )
            )
        segment = tuple(
            tuple(
                p[0] if len(p) == 1 else mx.concatenate(p, axis=2)
                for p in zip(*(piece[li] for piece in pieces), strict=True)
            )
            for li in range(len(pieces[0]))
        )
        mx.eval(segment)
        with self._lock:
            self.stats.hits += 1
            self.stats.tokens_loaded += end - start
            self.stats.bytes_loaded += sum(f.nbytes for f, _, _ in files)
            self.stats.load_seconds += time.perf_counter() - t0
        return segment

    def _read(self, f: DiskFile) -> list[list[mx.array]] | None:
        path = self.folder / (f.name + SUFFIX)
        try:
            data = path.read_bytes()
        except OSError as e:
            return self._bad(f, f"cannot be read ({e})")
        if len(data) != f.nbytes or _checksum(data) != f.digest:
            return self._bad(f, "does not match its checksum")
        try:
            arrays = mx.load(io.BytesIO(data), format="safetensors")
        except Exception as e:  # a file MLX cannot parse is as bad as a corrupt one
            return self._bad(f, f"cannot be parsed ({e})")
        layers: list[list[mx.array]] = []
        for name in sorted(arrays, key=lambda n: tuple(map(int, n.split(".")))):
            li, _ = map(int, name.split("."))
            while len(layers) <= li:
                layers.append([])
            layers[li].append(arrays[name])
        return layers

    def _bad(self, f: DiskFile, why: str) -> None:
        log.warning("dropping cache file %s: it %s", f.name, why)
        with self._lock:
            if f in self._lru and self._db_open:
                self._drop(f)
                self.stats.dropped += 1
                self._db.commit()
        return None

    # -------------------------------------------------------------- writes

    def put(self, model: Hashable, key: bytes, start: int, segment: Segment, layout: str) -> None:
        """Queue the KV of tokens [start, len(key)) of `key`'s path for writing.

        Written behind: only what the disk lacks of the path, and only if the disk
        holds the path up to `start` by then.
        """
        if self._closed or self.max_bytes == 0:
            return
        with self._lock:
            self.stats.pending += 1
        self._jobs.put((namespace_of(model), bytes(key), start, segment, layout))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued so far are done; False if `timeout` passed first."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish queued writes (within `timeout`), then stop the writer."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._writer.join(timeout)
        with self._lock:  # a write still under way finds the index closed and stops
            self._db.commit()
            self._db.close()
            self._db_open = False

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "flush":
                job[1].set()
                continue
            try:
                self._write(*job)
            except Exception:  # never fatal: the RAM tier still holds it
                log.exception("writing a cache segment to disk failed")
                with self._lock:
                    self.stats.skipped += 1
            finally:
                with self._lock:
                    self.stats.pending -= 1

    def _write(self, ns: str, key: bytes, start: int, segment: Segment, layout: str) -> None:
        n = len(key) // TOKEN
        with self._lock:
            if not self._db_open:
                return
            root = self._roots.get(ns)
            have = walk(root, key).length if root is not None else 0
            if have >= n:  # already on disk: only recency changes
                self._touch(root, key)
                return
            if have < start or (self._layout is not None and layout != self._layout):
                self.stats.skipped += 1  # the disk lost the path's beginning
                return
            if have > start:
                segment = tuple(
                    tuple(a[..., have - start :, :] for a in layer) for layer in segment
                )
            arrays = {
                f"{li}.{ai}": a for li, layer in enumerate(segment) for ai, a in enumerate(layer)
            }
            reserve = sum(a.nbytes for a in arrays.values())
            reserve += HEADER_SLACK + ENTRY_SLACK * len(arrays)
            if not self._make_room(reserve, root, key):
                self.stats.skipped += 1
                return
            self._nbytes += reserve
        name = uuid.uuid4().hex
        path, tmp = self.folder / (name + SUFFIX), self.folder / f"{name}.tmp{SUFFIX}"
        t0 = time.perf_counter()
        try:
            meta = {"format": str(FORMAT), "start": str(have), "end": str(n)}
            mx.save_safetensors(str(tmp), arrays, metadata=meta)
            os.chmod(tmp, 0o600)
            data = tmp.read_bytes()
            if len(data) > reserve:
                raise OSError(f"a {len(data)}-byte file over its {reserve}-byte reservation")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.warning("cannot write a cache segment to disk: %s", e)
            with self._lock:
                self._nbytes -= reserve
                self.stats.skipped += 1
            return
        f = DiskFile(name, ns, have, n, len(data), _checksum(data))
        with self._lock:
            self._nbytes -= reserve
            if not self._db_open:
                path.unlink(missing_ok=True)  # its row can no longer be written
                return
            if self._attach(f, key) is None:  # its path's beginning was dropped meanwhile
                path.unlink(missing_ok=True)
                self.stats.skipped += 1
                return
            self._layout = layout
            self._nbytes += f.nbytes
            self._lru[f] = None
            self._touch(self._roots[ns], key)
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name, ns, have, n, key, f.nbytes, f.digest, layout, time.time()),
            )
            self._db.commit()
            self.stats.writes += 1
            self.stats.bytes_written += f.nbytes
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.files, self.stats.bytes = len(self._lru), self._nbytes

    # ------------------------------------------------------ tree and budget

    def _attach(self, f: DiskFile, key: bytes) -> Node | None:
        """Hang `f`'s tokens [start, end) of `key` in its namespace's tree; None if the
        tree does not hold the path up to `start` (or already holds all of it)."""
        root = self._roots.setdefault(f.namespace, Node(edge=b""))
        w = walk(root, key[: f.end * TOKEN])
        if w.length != f.start:
            return None
        parent = w.nodes[-1] if w.nodes else root
        if w.partial:  # the head and the tail of the edge lie in the same file
            end = parent
            parent = split(end, w.length - end.start)
            parent.segment = end.segment
            end.segment.nodes.append(parent)
        node = add_child(parent, key[f.start * TOKEN : f.end * TOKEN])
        node.segment = f
        f.nodes.append(node)
        return node

    def _touch(self, root: Node, key: bytes) -> None:
        self._used({node.segment: None for node in walk(root, key).nodes})

    def _used(self, files: dict[DiskFile, None]) -> None:
        """Files just used, in path order: the beginning of a path is never older than its end."""
        for f in files:
            self._lru.move_to_end(f)
        now = time.time()
        self._db.executemany(
            "UPDATE files SET used = ? WHERE name = ?", [(now, f.name) for f in files]
        )

    def _make_room(self, need: int, root: Node | None, key: bytes) -> bool:
        if need > self.max_bytes:
            return False
        keep = {n.segment for n in walk(root, key).nodes} if root is not None else set()
        while self._nbytes + need > self.max_bytes:
            victim = next((f for f in self._lru if f not in keep), None)
            if victim is None:
                return False
            self._drop(victim)
            self.stats.evicted += 1
        return True

    def _drop(self, f: DiskFile) -> None:
        """Remove `f`, the nodes in it and everything below them."""
        # Every file below one of f's nodes continues a path through f's tokens.
        gone = {f: None}
        for node in list(f.nodes):
            if node.parent is None:
                continue  # already cut off with an ancestor in f
            detach(node)
            for below in iter_nodes(node):
                gone[below.segment] = None
        for g in gone:
            if g in self._lru:
                del self._lru[g]
                self._nbytes -= g.nbytes
                self._forget(g.name)
        self.stats.files, self.stats.bytes = len(self._lru), self._nbytes

    def _forget(self, name: str) -> None:
        with contextlib.suppress(OSError):
            (self.folder / (name + SUFFIX)).unlink()
        self._db.execute("DELETE FROM files WHERE name = ?", (name,))

    def clear(self, model: Hashable | None = None) -> None:
        """Remove the files of `model` (of every model when None)."""
        with self._lock:
            ns = None if model is None else namespace_of(model)
            for f in [f for f in self._lru if ns is None or f.namespace == ns]:
                if f in self._lru:
                    self._drop(f)
            for name in [ns] if ns is not None else list(self._roots):
                root = self._roots.get(name)
                if root is not None and not root.children:
                    del self._roots[name]
            self._db.commit()


def _checksum(data: bytes) -> str:
    # Against disks and crashes, not attackers (the folder is the owner's alone): CRC-32
    # reads at memory speed, where a cryptographic hash would halve the load bandwidth.
    return f"crc32:{zlib.crc32(data):08x}"
