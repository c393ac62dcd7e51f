"""Reading into the RAM tree what the disk tier holds of a prompt past the RAM tree's
match, as a segment an insert would have attached.

`DiskLoading` is a part of `PromptCache`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import layers, planning
from .radix import TOKEN, Tokens, packed_key, walk
from .tree import CacheStats, ModelTree

if TYPE_CHECKING:
    from collections.abc import Hashable
    from typing import Any

    from .disk import DiskTier

log = logging.getLogger("mlx_cache_server.prompt_cache.manager")

MIN_DISK_LOAD = 16  # fewer tokens past the RAM tree are recomputed, not read from disk


class DiskLoading:
    disk: DiskTier | None
    max_bytes: int
    _lock: Any
    _trees: dict[Hashable, ModelTree]
    _stats: dict[Hashable, CacheStats]

    def load_from_disk(self, model: Hashable, tokens: Tokens) -> int:
        """Load into the RAM tree what the disk tier holds of `tokens` past the RAM tree's
        match; the tokens loaded. A server calls it off its engine's thread before the
        fetch (which then finds them in RAM), so reading a conversation back from disk
        holds up no running generation. Never raises: the disk tier is only a help.
        """
        return self._load_guarded(model, packed_key(tokens)) if self.disk is not None else 0

    def _load_guarded(self, model: Hashable, key: bytes) -> int:
        try:
            return self._load_from_disk(model, key)
        except Exception:
            log.exception("loading a prompt's KV from the disk tier failed")
            return 0

    def _load_from_disk(self, model: Hashable, key: bytes) -> int:
        n = len(key) // TOKEN
        if self.disk.layout is None:
            return 0
        layout = layers.layout_from_json(self.disk.layout)
        with self._lock:
            tree = self._trees.get(model)
            if tree is not None and tree.layout != layout:
                return 0  # the RAM tree stores this model otherwise (snapshots, say)
            have = walk(tree.root, key).length if tree is not None else 0
        end = min(self.disk.match(model, key), n)
        # No more than the RAM budget holds: what cannot be attached is not read.
        while end - have >= MIN_DISK_LOAD and self.disk.span_bytes(model, key, have, end) > (
            self.max_bytes
        ):
            end = have + (end - have) // 2
        if end - have < MIN_DISK_LOAD:
            return 0
        segment = self.disk.load(model, key, have, end)
        if segment is None:
            return 0
        prep = planning.Prepared(start=have, segment=segment)
        key = key[: end * TOKEN]
        with self._lock:
            tree = self._trees.get(model)
            if tree is None:
                stats = self._stats.setdefault(model, CacheStats())
                tree = self._trees[model] = ModelTree(layout, stats)
            w = walk(tree.root, key)
            if tree.layout != layout or not have <= w.length < end:
                return 0  # the RAM tree changed meanwhile: what was loaded no longer fits
            anchor = self._anchor(tree, w, end, prep)
            self._pin([anchor])
            try:
                if not self._attach_segment(tree, anchor, w.length, key, prep):
                    return 0
                tree.stats.disk_hits += 1
                tree.stats.tokens_from_disk += end - w.length
                return end - w.length
            finally:
                self._unpin(tree, [anchor])
