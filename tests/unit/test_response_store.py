"""Stored responses: bounded, per tenant, and on disk across a restart."""

from __future__ import annotations

import logging

import pytest

from app.serving.errors import APIError
from app.serving.response_store import ResponseStore


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
