"""The prompt-cache manager: per-model radix trees of KV state under one LRU budget.

`PromptCache.fetch(model, tokens)` returns the best reusable state for a token
sequence and how many tokens it covers; `insert(model, tokens, cache)` stores
the state of a sequence. Rules:

- At least one token of a fetched sequence is always left uncovered: the model
  must run on something to produce logits.
- Storage mode is chosen per model from its first inserted cache (see
  `mlx_cache_server.prompt_cache.layers`):
  * prefix sharing, when every layer is a `KVCache`/`QuantizedKVCache`: each
    node owns the KV of its own edge only, so a shared prefix is stored once.
    Any point on a stored path is reusable: a fetch joins the segments of the
    path up to the common prefix (a longer match is simply cut there). Here a
    sequence that extends a stored one replaces it, and cached sequences are
    exactly the leaves.
  * checkpointed, for hybrid models (`mlx_cache_server.prompt_cache.checkpoints`): the KV layers
    as in prefix sharing, the window layers' KV by token where it was held,
    recurrent state at chosen nodes; a fetch resumes at the deepest point within
    its match where every layer can be rebuilt.
  * snapshot otherwise: a terminal node holds the whole cache of its sequence.
    A fetch restores the deepest stored prefix, or a longer stored sequence
    trimmed back to the common prefix when its layers are trimmable.
- Eviction works on cached sequences, least recently used first (a fetch or
  insert counts as use), until both `max_sequences` and `max_bytes` hold. A
  sequence goes whole, except when only bytes are short and, in prefix-sharing
  mode, the end of the sequence that no other one shares is enough: then only
  that many tokens are cut off its end (`Budget`), and the rest stays for its
  next turn, as long as the copy this takes is at most `SHORTEN_COPY` times
  the bytes freed (MLX cannot free part of a buffer, so what is kept of the
  last segment is copied).
  Nodes a running fetch or insert uses are pinned and never removed under it.
  An insert whose model was cleared while it copied, taking the whole tree, is
  refused: every byte counted is in a tree a fetch can reach.
  An insert that cannot fit is refused, so the byte count never exceeds
  `max_bytes`, at any moment a reader can observe.
- Bytes are the bytes of the arrays held for the tokens stored, not buffer
  capacity: stored KV is cut to its tokens and copied off the caller's buffers.
- One lock guards the trees, the LRU order and the counters. Copies (joining
  segments on fetch, cutting the new segment on insert) run outside it. The
  cache's parts (`Ledger`, `Budget`, `Attacher`) run under it, taken by the
  cache; the disk loader (`DiskLoader`) takes it itself, around the disk's reads.
- With a disk tier (`mlx_cache_server.prompt_cache.disk`, prefix-sharing mode only), every segment
  an insert attaches is queued for writing behind it, and a fetch first loads
  into the RAM tree what the disk holds of its tokens past the RAM tree's match
  (at least `MIN_DISK_LOAD` tokens), as a segment an insert would have attached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

from . import layers, planning
from .attaching import Attacher
from .budget import NO_LIMIT, Budget
from .disk import DiskTier
from .disk_loading import DiskLoader
from .eviction import LRUOrder
from .ledger import Ledger
from .outline import Outline, mark_on_disk, outline
from .planning import Kind
from .radix import TOKEN, Node, Tokens, iter_nodes, packed_key, walk
from .tree import CacheStats, ModelTree

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A fetch result: a cache the caller owns (or None) covering `n_cached` tokens."""

    cache: list[Any] | None
    n_cached: int
    kind: Kind


class PromptCache:
    """A thread-safe prompt cache shared by all requests, keyed by model and tokens.

    It owns the lock, the trees, the per-model counters and the LRU order, and hands them
    to its parts: the ledger (byte count, clock, node bookkeeping), the budget (limits,
    eviction), the attacher (hanging what an insert copied) and, with a disk tier, the
    disk loader. Methods here take the lock; the parts' methods expect it held, but the
    loader's, which takes it itself.
    """

    def __init__(
        self,
        max_sequences: int = 64,
        max_bytes: int | None = None,
        disk: DiskTier | None = None,
        measure: Callable[[Any], int] = layers.nbytes,
    ) -> None:
        """`measure`: the bytes counted for stored arrays, their own by default (a sharded
        model's ranks count theirs as the rank holding the most would, to evict alike)."""
        if max_sequences < 0 or (max_bytes is not None and max_bytes < 0):
            raise ValueError("cache limits must be >= 0")
        self.disk = disk
        self.measure = measure
        self._lock = threading.Lock()
        self._trees: dict[Hashable, ModelTree] = {}
        self._stats: dict[Hashable, CacheStats] = {}
        self._lru: LRUOrder[Node, ModelTree] = LRUOrder()
        self._ledger = Ledger(self._lru)
        limit = NO_LIMIT if max_bytes is None else max_bytes
        self._budget = Budget(max_sequences, limit, self._trees, self._lru, self._ledger, measure)
        self._attacher = Attacher(self._ledger, self._budget, measure)
        self._loader = None if disk is None else DiskLoader(
            disk, self._lock, self._trees, self._stats, self._ledger, self._attacher, self._budget
        )  # fmt: skip

    # ----------------------------------------------------------------- reads

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._ledger.nbytes

    @property
    def max_sequences(self) -> int:
        return self._budget.max_sequences

    @max_sequences.setter
    def max_sequences(self, value: int) -> None:
        self._budget.max_sequences = value

    @property
    def max_bytes(self) -> int:
        """The byte budget (`NO_LIMIT` when there is none); a new one holds from the next
        insert on."""
        return self._budget.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._budget.max_bytes = value

    @property
    def byte_budget(self) -> int | None:
        """`max_bytes` as given: None when there is no byte budget."""
        return None if self.max_bytes == NO_LIMIT else self.max_bytes

    def stats(self, model: Hashable | None = None) -> CacheStats:
        """Counters for one model, or summed over all models."""
        with self._lock:
            total = CacheStats()
            for key, stats in self._stats.items():
                if model is None or key == model:
                    total += stats
            return total

    def stats_by_model(self) -> dict[Hashable, CacheStats]:
        """A copy of every model's counters, including models asked for but never stored."""
        with self._lock:
            return {key: replace(stats) for key, stats in self._stats.items()}

    def models(self) -> list[Hashable]:
        """Models with cached state."""
        with self._lock:
            return list(self._trees)

    # ----------------------------------------------------------------- fetch

    def fetch(self, model: Hashable, tokens: Tokens) -> Fetched:
        """The best reusable state for `tokens`; the returned cache is the caller's.

        With a disk tier, what it holds of the prompt past the RAM tree is loaded into
        the RAM tree first.
        """
        key = packed_key(tokens)
        if self._loader is not None:
            self._loader.load(model, key)
        with self._lock:
            stats = self._stats.setdefault(model, CacheStats())
            stats.lookups += 1
            stats.tokens_asked += len(key) // TOKEN
            tree = self._trees.get(model)
            plan = self._plan(tree, key) if tree is not None else None
            if plan is None:
                stats.misses += 1
                return Fetched(None, 0, "miss")
            setattr(tree.stats, plan.kind, getattr(tree.stats, plan.kind) + 1)
            tree.stats.tokens_reused += plan.n
            self._ledger.pin(plan.pinned)
            now = time.time()
            for node in plan.pinned:
                node.hits, node.seen = node.hits + 1, now
            if tree.layout.checkpointed:
                now = self._ledger.tick()  # what it resumes from was used
                for node in plan.pinned:
                    node.used = now
            if plan.used is not None and plan.used.terminal:
                self._ledger.touch(plan.used, tree)
        try:
            if plan.entry is not None:
                cache = layers.clone(plan.entry)
                if plan.trim:
                    layers.trim(cache, plan.trim)
            elif tree.layout.checkpointed:
                cache = layers.assemble_checkpointed(
                    tree.layout, plan.pieces, plan.windows, plan.saved, plan.n
                )
            else:
                cache = layers.assemble(tree.layout, plan.pieces)
        finally:
            with self._lock:
                self._ledger.unpin(tree, plan.pinned)
        return Fetched(cache, plan.n, plan.kind)

    def peek(self, model: Hashable, tokens: Tokens) -> tuple[Kind, int]:
        """How a fetch would match now, without building a cache or counting a use."""
        key = packed_key(tokens)
        with self._lock:
            tree = self._trees.get(model)
            plan = self._plan(tree, key) if tree is not None else None
        return ("miss", 0) if plan is None else (plan.kind, plan.n)

    def _plan(self, tree: ModelTree, key: bytes) -> planning.Plan | None:
        """How `key` would be served from `tree` now. Expects the lock held."""
        n = len(key) // TOKEN
        if n < 2:
            return None
        w = walk(tree.root, key)
        if tree.layout.sliceable:
            return planning.plan_segments(w, n)
        if tree.layout.checkpointed:
            return planning.plan_checkpointed(tree.layout, w, n)
        return planning.plan_snapshot(w, n)

    # ------------------------------------------------------------------ disk

    def load_from_disk(self, model: Hashable, tokens: Tokens) -> int:
        """Load into the RAM tree what the disk tier holds of `tokens` past the RAM tree's
        match; the tokens loaded. A server calls it off its engine's thread before the
        fetch (which then finds them in RAM), so reading a conversation back from disk
        holds up no running generation. Never raises: the disk tier is only a help.
        """
        return self._loader.load(model, packed_key(tokens)) if self._loader is not None else 0

    # ---------------------------------------------------------------- insert

    def insert(self, model: Hashable, tokens: Tokens, cache: list[Any]) -> bool:
        """Store the state of `tokens`; False when it cannot fit in the limits.

        `cache` must hold exactly `tokens` (for KV caches its offset is checked).
        The caller keeps its cache: what is stored is cut and copied from it.
        """
        key = packed_key(tokens)
        n = len(key) // TOKEN
        layout = layers.layout_of(cache)
        held = layers.length(cache) if layout.segmented else None
        if held is not None and held != n:
            raise ValueError(f"the cache holds {held} tokens but {n} were given")
        if not n:
            return False
        with self._lock:
            tree = self._trees.get(model)
            if tree is None:
                stats = self._stats.setdefault(model, CacheStats())
                tree = self._trees[model] = ModelTree(layout, stats)
            elif tree.layout != layout:
                raise ValueError(
                    f"model {model!r} is cached with layers {tree.layout.kinds}, "
                    f"got {layout.kinds}; clear it before changing the model"
                )
            tree.stats.inserts += 1
            w = walk(tree.root, key)
            version = tree.version
            self._ledger.pin(w.nodes)
        try:
            prep = planning.prepare_insert(layout, w, n, cache, self.measure)
        except BaseException:
            with self._lock:
                self._ledger.unpin(tree, w.nodes)
            raise
        with self._lock:
            if self._trees.get(model) is not tree:
                # A clear dropped the whole tree meanwhile (nothing on the walk was pinned
                # to keep it): what this insert would attach could never be found again.
                self._ledger.unpin(tree, w.nodes)
                tree.stats.rejected += 1
                return False
            # The pinned path was not removed meanwhile, so it can only have grown.
            w2 = w if tree.version == version else walk(tree.root, key)
            anchor = self._attacher.anchor(tree, w2, n, prep)
            # Only the anchor needs to stay: evicting what hangs below it may
            # free the rest of the old path.
            self._ledger.pin([anchor])
            self._ledger.unpin(tree, w.nodes)
            try:
                if layout.sliceable:
                    attach = self._attacher.segment
                elif layout.checkpointed:
                    attach = self._attacher.checkpointed
                else:
                    attach = self._attacher.snapshot
                stored = attach(tree, anchor, w2.length, key, prep)
            finally:
                self._ledger.unpin(tree, [anchor])
            if not stored:
                tree.stats.rejected += 1
            elif self.disk is not None and layout.sliceable and w2.length < n:
                # Behind the RAM tier: the disk writes what it lacks of the path, which
                # may be more than this insert added (the disk drops files on its own).
                path = [(nd.start, nd.depth, nd.held.segment)
                        for nd in walk(tree.root, key).nodes]  # fmt: skip
                self.disk.put(model, key, path, layers.layout_json(layout))
            return stored

    # ------------------------------------------------------- eviction, outline

    def clear(self, model: Hashable | None = None) -> None:
        """Drop every cached sequence of `model` (of all models when None), on disk too.

        State a running fetch is using is dropped when that fetch ends.
        """
        if self.disk is not None:
            self.disk.clear(model)
        with self._lock:
            for key in [model] if model is not None else list(self._trees):
                tree = self._trees.get(key)
                if tree is None:
                    continue
                for node in [n for n in iter_nodes(tree.root) if n.terminal]:
                    self._ledger.drop(tree, node)
                if not tree.root.children:
                    del self._trees[key]

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> int:
        """Evict LRU sequences until at most `n_sequences` and `n_bytes` remain."""
        seqs = NO_LIMIT if n_sequences is None else max(0, n_sequences)
        nb = NO_LIMIT if n_bytes is None else max(0, n_bytes)
        with self._lock:
            return self._budget.trim(seqs, nb)

    def outline(self, max_nodes: int = 100, preview: int = 24) -> dict[Hashable, Outline]:
        """Each model key's largest branches and how many nodes were left out (`outline`),
        each branch marked where the disk tier holds its path too."""
        with self._lock:
            shown = {key: outline(tree.root, max_nodes, preview)
                     for key, tree in self._trees.items()}  # fmt: skip
        if self.disk is not None:  # outside the lock: the disk tier takes its own
            mark_on_disk(shown, self.disk)
        return shown
