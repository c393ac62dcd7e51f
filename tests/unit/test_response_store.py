"""Stored responses: bounded, per tenant, and on disk across a restart."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat

import pytest

from mlx_cache_server.serving.api_errors import APIError
from mlx_cache_server.serving.response_file import stored_responses_path
from mlx_cache_server.serving.response_store import ResponseStore


def _items(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("on_disk", [False, True])
def test_tenants_and_bounds(tmp_path, on_disk):
    store = ResponseStore(max_entries=2, path=tmp_path / "r.sqlite" if on_disk else None)
    store.put("a", "r1", _items("one"))
    store.put("b", "r2", _items("two"))
    assert store.conversation("a", "r1") == _items("one")  # r1 now the most recent
    with pytest.raises(APIError) as e:
        store.conversation("b", "r1")  # another tenant's
    assert e.value.status == 404
    store.put("a", "r3", _items("three"))  # evicts r2, the least recently used
    with pytest.raises(APIError):
        store.conversation("b", "r2")
    assert store.conversation("a", "r3") == _items("three")
    store.put("a", "r3", _items("again"))  # replaced, counted once
    assert store.conversation("a", "r3") == _items("again")
    assert store._chars == sum(size for _, size in store._entries.values())


def test_a_store_on_disk_outlives_the_server(tmp_path):
    path = tmp_path / "responses" / "m.sqlite"
    first = ResponseStore(path=path)
    first.put(None, "r1", _items("é" * 10))
    first.put("t", "r2", _items("two"))
    first.conversation(None, "r1")  # r1 used last: r2 goes first below
    again = ResponseStore(max_entries=1, path=path)
    assert again.conversation(None, "r1") == _items("é" * 10)
    with pytest.raises(APIError):
        again.conversation("t", "r2")  # evicted at opening, and from the file
    assert ResponseStore(path=path)._entries.keys() == {(None, "r1")}


def test_a_file_that_cannot_be_used_leaves_the_store_in_memory(tmp_path, caplog):
    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"not a database" * 100)
    with caplog.at_level(logging.WARNING):
        store = ResponseStore(path=path)
    assert "memory only" in caplog.text
    store.put(None, "r1", _items("x"))
    assert store.conversation(None, "r1") == _items("x")


def test_a_full_disk_loses_no_response(tmp_path):
    path = tmp_path / "r.sqlite"
    store = ResponseStore(path=path)
    store.put(None, "r1", _items("one"))
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the file cannot grow: SQLITE_FULL
    big = _items(os.urandom(50_000).hex())
    store.put("t", "r2", big)  # its write fails
    assert store.conversation(None, "r1") == _items("one")  # written before: still read
    assert store.conversation("t", "r2") == big  # from memory
    store._db.execute("PRAGMA max_page_count = 1073741823")  # space freed
    store.put(None, "r3", _items("three"))  # writes r2 first
    again = ResponseStore(path=path)
    assert again.conversation(None, "r1") == _items("one")
    assert again.conversation("t", "r2") == big
    assert again.conversation(None, "r3") == _items("three")


class FullDisk:
    """A connection whose writes fail while `full`, as SQLite's do on a full disk."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.full = db, True

    def execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        if self.full and not sql.startswith("SELECT"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, args)


def test_evictions_that_failed_reach_the_file_once_writes_work(tmp_path, caplog):
    path = tmp_path / "r.sqlite"
    store = ResponseStore(max_entries=2, path=path)
    store.put(None, "r1", _items("one"))
    store.put(None, "r2", _items("two"))
    store._db = disk = FullDisk(store._db)
    with caplog.at_level(logging.WARNING):
        store.put(None, "r3", _items("three"))  # not written, and r1's eviction neither
        store.put(None, "r3", _items("three!"))
    assert store.conversation(None, "r2") == _items("two")
    assert store.conversation(None, "r3") == _items("three!")
    assert caplog.text.count("a write failed") == 1  # once while it lasts
    disk.full = False
    store.put(None, "r4", _items("four"))  # evicts r2
    again = ResponseStore(max_entries=10, path=path)
    assert set(again._entries) == {(None, "r3"), (None, "r4")}
    assert again.conversation(None, "r3") == _items("three!")


def test_stored_responses_are_the_owners_alone(tmp_path):
    mask = os.umask(0)  # the modes must not depend on it
    try:
        new = ResponseStore(path=tmp_path / "new" / "m.sqlite")
        (tmp_path / "old").mkdir(mode=0o755)
        for name in ("m.sqlite", "m.sqlite-journal"):
            (tmp_path / "old" / name).touch(mode=0o644)
        existing = ResponseStore(path=tmp_path / "old" / "m.sqlite")
    finally:
        os.umask(mask)
    for store, folder in ((new, tmp_path / "new"), (existing, tmp_path / "old")):
        store._db.execute("BEGIN IMMEDIATE")
        store.put(None, "r1", _items("secret"))  # inside the transaction: its journal is there
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        for name in ("m.sqlite", "m.sqlite-journal"):
            assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600, name
        store._db.execute("COMMIT")


def test_distinct_model_ids_never_share_a_file(tmp_path):
    ids = ("org/m", "org_m", "org m", "Org_M")
    assert len({stored_responses_path(tmp_path, m) for m in ids}) == len(ids)

    def store(model_id: str) -> ResponseStore:
        return ResponseStore(path=stored_responses_path(tmp_path, model_id), model_id=model_id)

    store("org/m").put(None, "r1", _items("slash"))
    store("org_m").put(None, "r2", _items("underscore"))
    with pytest.raises(APIError):
        store("org_m").conversation(None, "r1")
    with pytest.raises(APIError):
        store("org/m").conversation(None, "r2")
    assert store("org/m").conversation(None, "r1") == _items("slash")


def test_a_file_of_the_old_naming_is_taken_over_only_where_it_is_surely_the_models(
    tmp_path, caplog
):
    folder = tmp_path / "responses"
    ResponseStore(path=folder / "Model-1.5B.sqlite").put(None, "r1", _items("mine"))
    ResponseStore(path=folder / "org_m.sqlite").put(None, "r2", _items("whose?"))
    path = stored_responses_path(tmp_path, "Model-1.5B")
    assert ResponseStore(path=path, model_id="Model-1.5B").conversation(None, "r1") == _items(
        "mine"
    )
    assert not (folder / "Model-1.5B.sqlite").exists()
    with caplog.at_level(logging.WARNING):
        ours = stored_responses_path(tmp_path, "org/m")
        with pytest.raises(APIError):  # "org_m" may have written it as well
            ResponseStore(path=ours, model_id="org/m").conversation(None, "r2")
    assert "org_m.sqlite are not read" in caplog.text
    assert (folder / "org_m.sqlite").exists()  # left for the operator
