"""The disk tier's SQLite index, and the folder around it: one row per file, read once
at start; other fingerprints' folders long unused removed.

A row names a file and records its namespace, its token range [start, end), every
token of its path up to `end`, its size, its checksum, the cache layout and when it
was last used. The checksum covers the file and the row's facts that decide what the
file is served as (`disk_files.binding`): all but its size, checked against the
file's, and when it was used. The index is the owner's alone (0600) and keeps no trace of a
deleted row (secure_delete).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .radix import TOKEN

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
STALE_AFTER = 7 * 24 * 3600  # seconds unused before another fingerprint's folder is removed


@dataclass
class Row:
    name: str
    namespace: str
    start: int
    end: int
    tokens: bytes  # the path's tokens [0, end), packed
    nbytes: int
    digest: str
    layout: str


def open_index(folder: Path) -> sqlite3.Connection:
    """The folder's index, created if new; a damaged one is replaced by an empty one
    (and its files removed): it costs what it indexed, never the start."""
    path = folder / "index.sqlite"
    for attempt in (1, 2):
        try:
            db = sqlite3.connect(path, check_same_thread=False)
            db.execute("PRAGMA secure_delete = ON")  # a cleared prompt leaves no trace
            db.execute(
                "CREATE TABLE IF NOT EXISTS files (name TEXT PRIMARY KEY, namespace TEXT, "
                "start INTEGER, end_ INTEGER, tokens BLOB, nbytes INTEGER, digest TEXT, "
                "layout TEXT, used REAL)"
            )
            db.commit()
            os.chmod(path, 0o600)
            return db
        except sqlite3.DatabaseError as e:
            if attempt == 2 or isinstance(e, sqlite3.OperationalError):
                raise  # a read-only or full disk: the caller serves without the tier
            log.warning("cache index %s is unreadable (%s): starting empty", path, e)
            for p in folder.iterdir():
                if p.name.startswith("index.sqlite") or p.name.endswith(SUFFIX):
                    p.unlink(missing_ok=True)
    raise AssertionError("unreachable")


def read_rows(db: sqlite3.Connection, folder: Path) -> tuple[list[Row], list[tuple[str, str]]]:
    """The rows whose files are there at their recorded size, least recently used first;
    and (name, reason) for each row that is not."""
    good, bad = [], []
    raw = db.execute(
        "SELECT name, namespace, start, end_, tokens, nbytes, digest, layout FROM files "
        "ORDER BY used"
    ).fetchall()
    for name, ns, start, end, tokens, nbytes, digest, layout in raw:
        why = _bad_row(folder, name, start, end, tokens, nbytes)
        if why is None:
            good.append(Row(name, str(ns), start, end, tokens, nbytes, str(digest), str(layout)))
        else:
            bad.append((str(name), why))
    return good, bad


def _bad_row(folder: Path, name: Any, start: Any, end: Any, tokens: Any, nbytes: Any) -> str | None:
    ints = isinstance(start, int) and isinstance(end, int) and isinstance(nbytes, int)
    if not (isinstance(name, str) and ints and isinstance(tokens, bytes) and 0 <= start < end
            and len(tokens) == end * TOKEN):  # fmt: skip
        return "its index row is malformed"
    path = folder / (name + SUFFIX)
    if not path.is_file():
        return "its file is missing"
    if path.stat().st_size != nbytes:
        return f"its file is {path.stat().st_size} bytes, not the {nbytes} written (truncated)"
    return None


def insert(db: sqlite3.Connection, row: Row) -> None:
    db.execute(
        "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (row.name, row.namespace, row.start, row.end, row.tokens, row.nbytes, row.digest,
         row.layout, time.time()),
    )  # fmt: skip


def forget(db: sqlite3.Connection, folder: Path, name: str) -> None:
    """Remove a file and its row; a row left behind (the index failing) is dropped at the
    next start, its file being gone."""
    (folder / (name + SUFFIX)).unlink(missing_ok=True)
    with contextlib.suppress(sqlite3.Error):
        db.execute("DELETE FROM files WHERE name = ?", (name,))


def commit_recency(db: sqlite3.Connection, touched: dict[str, float]) -> None:
    db.executemany("UPDATE files SET used = ? WHERE name = ?", [(t, n) for n, t in touched.items()])
    touched.clear()
    db.commit()


class Index:
    """A tier folder's open index: its rows, and the files they name.

    Nothing here locks: the tier's lock guards every call (`DiskTier`). `open` is True
    until `close`; after it nothing may be written.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._db = open_index(folder)
        self.open = True

    def rows(self) -> tuple[list[Row], list[tuple[str, str]]]:
        return read_rows(self._db, self.folder)

    def insert(self, row: Row) -> None:
        insert(self._db, row)

    def forget(self, name: str) -> None:
        forget(self._db, self.folder, name)

    def commit_recency(self, touched: dict[str, float]) -> None:
        commit_recency(self._db, touched)

    def commit(self) -> None:
        self._db.commit()

    def close(self) -> None:
        self._db.close()
        self.open = False


def remove_stale(root: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove other fingerprints' folders under `root` (another model, an older version of
    this one) that no process holds and that were not written for `STALE_AFTER` seconds;
    the folders removed. Only folders laid out as a disk tier's are touched."""
    now = time.time() if now is None else now
    removed = []
    for folder in sorted(root.iterdir()):
        index, lockfile = folder / "index.sqlite", folder / "lock"
        if folder == keep or not (index.is_file() and lockfile.is_file()):
            continue
        try:
            if now - index.stat().st_mtime < STALE_AFTER:
                continue
            with open(lockfile, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a server using it holds this
                shutil.rmtree(folder)
        except OSError:
            continue
        log.info("removed %s: another fingerprint's disk cache, unused for a week", folder)
        removed.append(folder)
    return removed
