"""Least-recently-used order over cached sequences, kept apart from matching.

Each cached sequence is the terminal node where it ends; the order maps that
node to whatever the manager files it under (its model's tree). Choosing a
victim is the policy; what eviction frees is the manager's business.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUOrder(Generic[K, V]):
    def __init__(self) -> None:
        self._order: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: K, value: V) -> None:
        """Mark `key` as just used (adding it if new)."""
        self._order[key] = value
        self._order.move_to_end(key)

    def discard(self, key: K) -> None:
        self._order.pop(key, None)

    def replace(self, old: K, new: K) -> None:
        """`new` takes `old`'s place in the order (a sequence that now ends elsewhere)."""
        self._order = OrderedDict((new if k is old else k, v) for k, v in self._order.items())

    def victim(self, evictable: Callable[[K], bool]) -> tuple[K, V] | None:
        """The least recently used key that may be evicted now, with its value."""
        for key, value in self._order.items():
            if evictable(key):
                return key, value
        return None
