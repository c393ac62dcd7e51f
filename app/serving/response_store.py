"""Stored responses, for `previous_response_id`: each response's whole conversation as
input items (its input, then its output), bounded, in memory, per tenant.

A request naming a previous response gets that conversation put before its own
input, so a client that sends only the new turn gets the same prompt as one
that sends everything; the cache serves what the previous turn computed either
way. `store: false` keeps a response out.

Invariants:
- A tenant never reads another tenant's responses: entries are keyed by both.
- At most `max_entries` responses and `max_chars` characters of items are kept;
  the least recently used go first. An evicted or unknown id is a 404 that says
  to send the whole input.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from .errors import APIError

Items = list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_chars: int = 64 << 20) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[tuple[str | None, str], tuple[Items, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, tenant: str | None, response_id: str, items: Items) -> None:
        size = len(json.dumps(items, ensure_ascii=False))
        if size > self.max_chars:
            return  # larger than the whole store: never kept
        with self._lock:
            self._entries[(tenant, response_id)] = (items, size)
            self._chars += size
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                _, (_, gone) = self._entries.popitem(last=False)
                self._chars -= gone

    def conversation(self, tenant: str | None, response_id: str) -> Items:
        """The stored conversation of `response_id`, or a 404 in OpenAI's shape."""
        with self._lock:
            entry = self._entries.get((tenant, response_id))
            if entry is not None:
                self._entries.move_to_end((tenant, response_id))
        if entry is None:
            raise APIError(
                404,
                f"Previous response with id '{response_id}' not found: it was not stored "
                "(store: false), or it was evicted, or the server restarted. Send the whole "
                "conversation as input; the cache makes that nearly free.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return list(entry[0])
