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
  and the items are read when asked for. A file that cannot be opened, read or
  written leaves the store in memory (logged), never fails a request.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .errors import APIError

Items = list[dict[str, Any]]
Key = tuple[str | None, str]
log = logging.getLogger("mlx_cache_server")

SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, items BLOB NOT NULL, size INTEGER NOT NULL,
    used REAL NOT NULL, PRIMARY KEY (tenant, id))"""


class ResponseStore:
    def __init__(
        self, max_entries: int = 1024, max_chars: int = 64 << 20, path: Path | None = None
    ) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[Key, tuple[Items | None, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if path is not None:
            self._open(path)

    def _open(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
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
        text = json.dumps(items, ensure_ascii=False)
        size = len(text)
        if size > self.max_chars:
            return  # larger than the whole store: never kept
        with self._lock:
            if self._db is not None:
                row = (json.dumps(tenant), response_id, zlib.compress(text.encode()), size)
                self._write("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                            (*row, time.time()))  # fmt: skip
            old = self._entries.pop((tenant, response_id), None)
            self._chars += size - (old[1] if old else 0)
            self._entries[(tenant, response_id)] = (None if self._db else items, size)
            self._evict()

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            (tenant, response_id), (_, gone) = self._entries.popitem(last=False)
            self._chars -= gone
            self._write("DELETE FROM responses WHERE tenant = ? AND id = ?",
                        (json.dumps(tenant), response_id))  # fmt: skip

    def _write(self, sql: str, args: tuple) -> None:
        if self._db is None:
            return
        try:
            self._db.execute(sql, args)
        except sqlite3.Error as e:
            log.warning("stored responses kept in memory only from now: %s", e)
            self._db = None

    def _read(self, key: Key) -> Items | None:
        if self._db is None:
            return None
        try:
            row = self._db.execute("SELECT items FROM responses WHERE tenant = ? AND id = ?",
                                   (json.dumps(key[0]), key[1])).fetchone()  # fmt: skip
            if row is None:
                return None
            self._db.execute("UPDATE responses SET used = ? WHERE tenant = ? AND id = ?",
                             (time.time(), json.dumps(key[0]), key[1]))  # fmt: skip
            return json.loads(zlib.decompress(row[0]))
        except (sqlite3.Error, zlib.error, ValueError) as e:
            log.warning("a stored response could not be read: %s", e)
            return None

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
