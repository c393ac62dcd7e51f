"""A shared, thread-safe prompt cache for mlx-lm models (no web framework inside)."""

from .compat import LRUPromptCache
from .disk import DiskTier
from .joined import as_fresh, fresh_cache
from .manager import CacheStats, Fetched, PromptCache
from .radix import PackedTokens

__all__ = [
    "CacheStats",
    "DiskTier",
    "Fetched",
    "LRUPromptCache",
    "PackedTokens",
    "PromptCache",
    "as_fresh",
    "fresh_cache",
]
