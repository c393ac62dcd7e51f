"""`LRUPromptCache`: mlx-lm's prompt-cache surface on top of `PromptCache`.

Code written against `mlx_lm.models.cache.LRUPromptCache` (mlx_lm.server among
it) can swap this in unchanged. One difference is deliberate: an exact match
still leaves the last token to run, so `rest` is never empty.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .manager import PromptCache


class LRUPromptCache:
    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63) -> None:
        self._cache = PromptCache(max_sequences=max_size, max_bytes=max_bytes)

    @property
    def max_size(self) -> int:
        return self._cache.max_sequences

    @property
    def max_bytes(self) -> int:
        return self._cache.max_bytes

    @property
    def cache(self) -> PromptCache:
        return self._cache

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes

    def fetch_nearest_cache(self, model: Hashable, tokens: list[int]) -> tuple[Any, list[int]]:
        found = self._cache.fetch(model, tokens)
        return found.cache, tokens[found.n_cached :]

    def insert_cache(
        self,
        model: Hashable,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        # cache_type steers the peer's per-type eviction queues; one LRU serves all here.
        self._cache.insert(model, tokens, prompt_cache)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self._cache.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return {"all": {"n_sequences": len(self._cache), "n_bytes": self._cache.nbytes}}
