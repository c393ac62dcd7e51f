"""Reading into the RAM tree what the disk tier holds of a prompt past the RAM tree's
match, as a segment an insert would have attached.

Invariants: no more is read than the RAM budget could hold; what is read is attached
only where the RAM tree still matches what it matched before the read (the lock is
not held across the disk's reads), else it is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

from . import layers, planning
from .attaching import Attacher
from .budget import Budget
from .disk import DiskTier
from .ledger import Ledger
from .radix import TOKEN, walk
from .tree import CacheStats, ModelTree

log = logging.getLogger("mlx_cache_server.prompt_cache.manager")

MIN_DISK_LOAD = 16  # fewer tokens past the RAM tree are recomputed, not read from disk


class DiskLoader:
    """A `PromptCache`'s reads from its disk tier into its trees.

    Given the tier, the cache's lock (taken here, and let go while the disk reads), its
    trees and per-model counters (a load may plant a model's tree, as an insert does),
    its ledger (pins), its attacher and its budget (`max_bytes` bounds a read).
    """

    def __init__(
        self,
        disk: DiskTier,
        lock: threading.Lock,
        trees: dict[Hashable, ModelTree],
        stats: dict[Hashable, CacheStats],
        ledger: Ledger,
        attacher: Attacher,
        budget: Budget,
    ) -> None:
        self._disk = disk
        self._lock = lock
        self._trees = trees
        self._stats = stats
        self._ledger = ledger
        self._attacher = attacher
        self._budget = budget

    def load(self, model: Hashable, key: bytes) -> int:
        """Load into the RAM tree what the disk holds of `key` (packed tokens) past the RAM
        tree's match; the tokens loaded. Expects the lock free. Never raises: the disk
        tier is only a help."""
        try:
            return self._load(model, key)
        except Exception:
            log.exception("loading a prompt's KV from the disk tier failed")
            return 0

    def _load(self, model: Hashable, key: bytes) -> int:
        n = len(key) // TOKEN
        if self._disk.layout is None:
            return 0
        layout = layers.layout_from_json(self._disk.layout)
        with self._lock:
            tree = self._trees.get(model)
            if tree is not None and tree.layout != layout:
                return 0  # the RAM tree stores this model otherwise (snapshots, say)
            have = walk(tree.root, key).length if tree is not None else 0
        end = min(self._disk.match(model, key), n)
        # No more than the RAM budget holds: what cannot be attached is not read.
        while end - have >= MIN_DISK_LOAD and self._disk.span_bytes(model, key, have, end) > (
            self._budget.max_bytes
        ):
            end = have + (end - have) // 2
        if end - have < MIN_DISK_LOAD:
            return 0
        segment = self._disk.load(model, key, have, end)
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
            anchor = self._attacher.anchor(tree, w, end, prep)
            self._ledger.pin([anchor])
            try:
                if not self._attacher.segment(tree, anchor, w.length, key, prep):
                    return 0
                tree.stats.disk_hits += 1
                tree.stats.tokens_from_disk += end - w.length
                return end - w.length
            finally:
                self._ledger.unpin(tree, [anchor])
