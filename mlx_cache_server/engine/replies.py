"""The replies a model recently wrote for each tenant, to draft from.

A reply that repeats an earlier one is drafted from it (`drafting.PromptLookup`): a
regenerated or retried turn, the same question from a second session, an agent writing
back the file another of its turns already wrote. The sequence's own prompt cannot draft
these where the reply is not a copy of it. Each reply is kept with the last `ANCHOR`
tokens of its prompt, so that how a reply began is drafted too, once the prompt before
it matches.

Invariants: a reply is only ever drafted for requests of the cache key (model and tenant)
that wrote it, as the prompt cache never shares state across keys; the replies kept hold
at most `BUDGET` tokens, all keys together, the oldest dropped first; the same tokens are
kept once (kept again, they count as the latest); `clear` forgets them all. Thread-safe:
the engine thread adds and reads, a cache flush clears from another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .drafting import PromptLookup

ANCHOR = 32  # prompt tokens kept before each reply
BUDGET = 1 << 15  # tokens kept, all cache keys together
LATEST = 16  # replies of a key a draft looks in, latest first


class RecentReplies:
    """Replies kept per cache key; a budget of 0 keeps none (speculation off)."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._oldest_first: OrderedDict[tuple[Any, tuple[int, ...]], PromptLookup] = OrderedDict()
        self._tokens = 0

    def add(self, key: Any, tokens: list[int], prompt_length: int) -> None:
        """Keep the reply at the end of `tokens` (after its first `prompt_length`) for key."""
        start = max(0, prompt_length - ANCHOR)
        if len(tokens) <= prompt_length or len(tokens) - start > self.budget:
            return
        text = PromptLookup()
        text.extend(tokens[start:])
        kept = tuple(text.tokens)
        with self._lock:
            if self._oldest_first.pop((key, kept), None) is None:
                self._tokens += len(kept)
            self._oldest_first[(key, kept)] = text
            while self._tokens > self.budget:
                (_, dropped), _ = self._oldest_first.popitem(last=False)
                self._tokens -= len(dropped)

    def latest(self, key: Any) -> list[PromptLookup]:
        """The key's replies a draft looks in, latest first."""
        with self._lock:
            found = []
            for (k, _), text in reversed(self._oldest_first.items()):
                if k == key:
                    found.append(text)
                    if len(found) == LATEST:
                        break
            return found

    def clear(self) -> None:
        with self._lock:
            self._oldest_first.clear()
            self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens kept, all keys together."""
        return self._tokens
