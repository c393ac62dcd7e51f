"""Stored responses, for `previous_response_id`: each response's whole conversation as
input items (its input, then its output), bounded, per tenant, in memory or (given a
path) in an SQLite file that outlives the server.

A request naming a previous response gets that conversation put before its own
input, so a client that sends only the new turn gets the same prompt as one
that sends everything; the cache serves what the previous turn computed either
way. `store: false` keeps a response out.

Invariants:
- A tenant never reads another tenant's responses: entries are keyed by both.
- At most `max_entries` responses and `max_chars` characters of items are kept;
  the least recently used go first. An evicted or unknown id is a 404 that says
  to send the whole input.
- On disk, the file is the truth: memory holds each entry's size and recency,
  and the items are read when asked for; the file is named and protected by
  `response_file`. A file that cannot be opened or read leaves the store in
  memory (logged), never fails a request.
- A write that fails (a full disk) loses nothing: the entry keeps its items in
  memory, within the same bounds, and each later write first retries what failed
  before (entries, then evictions), so the file catches up once writing works
  again; entries already in the file stay readable meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .api_errors import APIError
from .response_file import open_private

Items = list[dict[str, Any]]
Key = tuple[str | None, str]
log = logging.getLogger("mlx_cache_server")

SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, items BLOB NOT NULL, size INTEGER NOT NULL,
    used REAL NOT NULL, PRIMARY KEY (tenant, id))"""
INSERT = "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)"
DELETE = "DELETE FROM responses WHERE tenant = ? AND id = ?"


class ResponseStore:
    def __init__(
        self,
        max_entries: int = 1024,
        max_chars: int = 64 << 20,
        path: Path | None = None,
        model_id: str | None = None,
    ) -> None:
        """`path`: the file (`response_file.stored_responses_path`), None: in memory only;
        `model_id`: whose it is, to take over its file of the old naming."""
        self.max_entries, self.max_chars = max_entries, max_chars
        # Items are None for an entry the file holds, in memory otherwise.
        self._entries: OrderedDict[Key, tuple[Items | None, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._unwritten: dict[Key, float] = {}  # entries whose write failed: when put
        self._undeleted: set[Key] = set()  # evictions whose delete failed
        self._failing = False
        if path is not None:
            self._open(path, model_id)

    def _open(self, path: Path, model_id: str | None) -> None:
        try:
            db = open_private(path, model_id)
            db.execute(SCHEMA)
            rows = db.execute("SELECT tenant, id, size FROM responses ORDER BY used").fetchall()
        except (OSError, sqlite3.Error) as e:
            log.warning("stored responses kept in memory only: %s cannot be used (%s)", path, e)
            return
        self._db = db
        for tenant, response_id, size in rows:
            self._entries[(json.loads(tenant), response_id)] = (None, size)
            self._chars += size
        self._evict()

    def put(self, tenant: str | None, response_id: str, items: Items) -> None:
        size = len(json.dumps(items, ensure_ascii=False))
        if size > self.max_chars:
            return  # larger than the whole store: never kept
        key = (tenant, response_id)
        with self._lock:
            old = self._entries.pop(key, None)
            self._chars += size - (old[1] if old else 0)
            self._undeleted.discard(key)
            self._unwritten.pop(key, None)
            written = self._db is not None and self._retry() and self._insert(key, items)
            self._entries[key] = (None if written else items, size)
            if self._db is not None and not written:
                self._unwritten[key] = time.time()
            self._evict()

    def _insert(self, key: Key, items: Items, used: float | None = None) -> bool:
        text = json.dumps(items, ensure_ascii=False)
        row = (json.dumps(key[0]), key[1], zlib.compress(text.encode()), len(text))
        return self._write(INSERT, (*row, time.time() if used is None else used))

    def _retry(self) -> bool:
        """Write what failed to be written before; False while writing still fails."""
        for key in list(self._undeleted):
            if not self._write(DELETE, (json.dumps(key[0]), key[1])):
                return False
            self._undeleted.discard(key)
        for key, used in list(self._unwritten.items()):
            items, size = self._entries[key]
            if not self._insert(key, items, used):
                return False
            del self._unwritten[key]
            self._entries[key] = (None, size)  # in place: its recency stays
        return True

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            key, (_, gone) = self._entries.popitem(last=False)
            self._chars -= gone
            self._unwritten.pop(key, None)
            if self._db is not None and not self._write(DELETE, (json.dumps(key[0]), key[1])):
                self._undeleted.add(key)

    def _write(self, sql: str, args: tuple) -> bool:
        try:
            self._db.execute(sql, args)
        except sqlite3.Error as e:
            if not self._failing:
                log.warning("stored responses: a write failed (%s); kept in memory and "
                            "written once writing works again", e)  # fmt: skip
            self._failing = True
            return False
        if self._failing:
            log.info("stored responses: writing works again")
            self._failing = False
        return True

    def _read(self, key: Key) -> Items | None:
        args = (json.dumps(key[0]), key[1])
        try:
            row = self._db.execute(
                "SELECT items FROM responses WHERE tenant = ? AND id = ?", args
            ).fetchone()
            items = None if row is None else json.loads(zlib.decompress(row[0]))
        except (sqlite3.Error, zlib.error, ValueError) as e:
            log.warning("a stored response could not be read: %s", e)
            return None
        with contextlib.suppress(sqlite3.Error):  # recency for a restart; memory has it
            self._db.execute("UPDATE responses SET used = ? WHERE tenant = ? AND id = ?",
                             (time.time(), *args))  # fmt: skip
        return items

    def conversation(self, tenant: str | None, response_id: str) -> Items:
        """The stored conversation of `response_id`, or a 404 in OpenAI's shape."""
        key = (tenant, response_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                if entry[0] is None:
                    entry = (self._read(key), entry[1])
        if entry is None or entry[0] is None:
            raise APIError(
                404,
                f"Previous response with id '{response_id}' not found: it was not stored "
                "(store: false), or it was evicted, or the server restarted without "
                "--cache-dir. Send the whole conversation as input; the cache makes that "
                "nearly free.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return list(entry[0])
