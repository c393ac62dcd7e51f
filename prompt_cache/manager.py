"""The prompt-cache manager: per-model radix trees of KV state under one LRU budget.

`PromptCache.fetch(model, tokens)` returns the best reusable state for a token
sequence and how many tokens it covers; `insert(model, tokens, cache)` stores
the state of a sequence. Rules:

- At least one token of a fetched sequence is always left uncovered: the model
  must run on something to produce logits.
- Storage mode is chosen per model from its first inserted cache (see
  `prompt_cache.layers`):
  * prefix sharing, when every layer is a `KVCache`/`QuantizedKVCache`: each
    node owns the KV of its own edge only, so a shared prefix is stored once.
    Any point on a stored path is reusable: a fetch joins the segments of the
    path up to the common prefix (a longer match is simply cut there). Here a
    sequence that extends a stored one replaces it, and cached sequences are
    exactly the leaves.
  * checkpointed, for hybrid models (`prompt_cache.checkpoints`): the KV layers
    as in prefix sharing, the other layers' state at chosen nodes; a fetch
    resumes at the deepest of those within its match.
  * snapshot otherwise: a terminal node holds the whole cache of its sequence.
    A fetch restores the deepest stored prefix, or a longer stored sequence
    trimmed back to the common prefix when its layers are trimmable.
- Eviction works on cached sequences, least recently used first (a fetch or
  insert counts as use), until both `max_sequences` and `max_bytes` hold. A
  sequence goes whole, except when only bytes are short and, in prefix-sharing
  mode, the end of the sequence that no other one shares is enough: then only
  that many tokens are cut off its end (`_shorten`), and the rest stays for its
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
  segments on fetch, cutting the new segment on insert) run outside it.
- With a disk tier (`prompt_cache.disk`, prefix-sharing mode only), every segment
  an insert attaches is queued for writing behind it, and a fetch first loads
  into the RAM tree what the disk holds of its tokens past the RAM tree's match
  (at least `MIN_DISK_LOAD` tokens), as a segment an insert would have attached.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import checkpoints, layers, planning
from .disk import DiskTier
from .eviction import LRUOrder
from .layers import Layout
from .planning import Kind
from .radix import (
    TOKEN,
    Node,
    PackedTokens,
    Walk,
    add_child,
    detach,
    iter_nodes,
    pack,
    split,
    walk,
)

log = logging.getLogger(__name__)


SHORTEN_COPY = 4  # most bytes copied per byte freed when cutting a sequence's end
MIN_DISK_LOAD = 16  # fewer tokens past the RAM tree are recomputed, not read from disk


@dataclass
class Fetched:
    """A fetch result: a cache the caller owns (or None) covering `n_cached` tokens."""

    cache: list[Any] | None
    n_cached: int
    kind: Kind


@dataclass
class CacheStats:
    lookups: int = 0
    exact: int = 0
    shorter: int = 0
    longer: int = 0
    misses: int = 0
    tokens_asked: int = 0
    tokens_reused: int = 0
    inserts: int = 0
    rejected: int = 0
    evictions: int = 0
    shortened: int = 0  # sequences whose end was cut off to make room, instead of evicted
    disk_hits: int = 0  # fetches that loaded part of their prompt's KV from the disk tier
    tokens_from_disk: int = 0
    sequences: int = 0
    bytes: int = 0

    def __iadd__(self, other: CacheStats) -> CacheStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @property
    def reuse(self) -> float:
        """Share of asked tokens that came from the cache."""
        return self.tokens_reused / self.tokens_asked if self.tokens_asked else 0.0


@dataclass(eq=False)
class _Tree:
    layout: Layout
    stats: CacheStats  # the model's counters, which outlive its tree (see clear)
    root: Node = field(default_factory=lambda: Node(edge=b""))
    version: int = 0  # bumped by every change to the tree's shape


Tokens = Sequence[int] | PackedTokens
"""A token list (or tuple, numpy or mlx array), or tokens packed once (`PackedTokens`)."""


def _key(tokens: Tokens | Any) -> bytes:
    """Packed tokens from a list, tuple, numpy or mlx array, or as they come."""
    if isinstance(tokens, PackedTokens):
        return tokens
    return pack(tokens.tolist() if hasattr(tokens, "tolist") else tokens)


_NO_LIMIT = 1 << 62


class PromptCache:
    """A thread-safe prompt cache shared by all requests, keyed by model and tokens."""

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
        self.max_sequences = max_sequences
        self.max_bytes = _NO_LIMIT if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._trees: dict[Hashable, _Tree] = {}
        self._stats: dict[Hashable, CacheStats] = {}
        self._lru: LRUOrder[Node, _Tree] = LRUOrder()
        self._nbytes = 0
        self._shorten_copy = SHORTEN_COPY
        self._clock = 0  # orders checkpoints by use

    # ----------------------------------------------------------------- reads

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def byte_budget(self) -> int | None:
        """`max_bytes` as given: None when there is no byte budget."""
        return None if self.max_bytes == _NO_LIMIT else self.max_bytes

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
        key = _key(tokens)
        if self.disk is not None:
            self._load_guarded(model, key)
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
            self._pin(plan.pinned)
            if plan.saved is not None:
                plan.pinned[-1].checkpoint_used = self._tick()  # the node it resumes at
            if plan.used is not None and plan.used.terminal:
                self._lru.touch(plan.used, tree)
        try:
            if plan.entry is not None:
                cache = layers.clone(plan.entry)
                if plan.trim:
                    layers.trim(cache, plan.trim)
            elif plan.saved is not None:
                cache = layers.assemble_checkpointed(tree.layout, plan.pieces, plan.saved)
            else:
                cache = layers.assemble(tree.layout, plan.pieces)
        finally:
            with self._lock:
                self._unpin(tree, plan.pinned)
        return Fetched(cache, plan.n, plan.kind)

    def peek(self, model: Hashable, tokens: Tokens) -> tuple[Kind, int]:
        """How a fetch would match now, without building a cache or counting a use."""
        key = _key(tokens)
        with self._lock:
            tree = self._trees.get(model)
            plan = self._plan(tree, key) if tree is not None else None
        return ("miss", 0) if plan is None else (plan.kind, plan.n)

    def _plan(self, tree: _Tree, key: bytes) -> planning.Plan | None:
        n = len(key) // TOKEN
        if n < 2:
            return None
        w = walk(tree.root, key)
        if tree.layout.sliceable:
            return planning.plan_segments(w, n)
        if tree.layout.checkpointed:
            return planning.plan_checkpointed(w, n)
        return planning.plan_snapshot(w, n)

    # ------------------------------------------------------------------ disk

    def load_from_disk(self, model: Hashable, tokens: Tokens) -> int:
        """Load into the RAM tree what the disk tier holds of `tokens` past the RAM tree's
        match; the tokens loaded. A server calls it off its engine's thread before the
        fetch (which then finds them in RAM), so reading a conversation back from disk
        holds up no running generation. Never raises: the disk tier is only a help.
        """
        return self._load_guarded(model, _key(tokens)) if self.disk is not None else 0

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
                tree = self._trees[model] = _Tree(layout, stats)
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

    # ---------------------------------------------------------------- insert

    def insert(self, model: Hashable, tokens: Tokens, cache: list[Any]) -> bool:
        """Store the state of `tokens`; False when it cannot fit in the limits.

        `cache` must hold exactly `tokens` (for KV caches its offset is checked).
        The caller keeps its cache: what is stored is cut and copied from it.
        """
        key = _key(tokens)
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
                tree = self._trees[model] = _Tree(layout, stats)
            elif tree.layout != layout:
                raise ValueError(
                    f"model {model!r} is cached with layers {tree.layout.kinds}, "
                    f"got {layout.kinds}; clear it before changing the model"
                )
            tree.stats.inserts += 1
            w = walk(tree.root, key)
            version = tree.version
            self._pin(w.nodes)
        try:
            prep = planning.prepare_insert(layout, w, n, cache, self.measure)
        except BaseException:
            with self._lock:
                self._unpin(tree, w.nodes)
            raise
        with self._lock:
            if self._trees.get(model) is not tree:
                # A clear dropped the whole tree meanwhile (nothing on the walk was pinned
                # to keep it): what this insert would attach could never be found again.
                self._unpin(tree, w.nodes)
                tree.stats.rejected += 1
                return False
            # The pinned path was not removed meanwhile, so it can only have grown.
            w2 = w if tree.version == version else walk(tree.root, key)
            anchor = self._anchor(tree, w2, n, prep)
            # Only the anchor needs to stay: evicting what hangs below it may
            # free the rest of the old path.
            self._pin([anchor])
            self._unpin(tree, w.nodes)
            try:
                if layout.sliceable:
                    stored = self._attach_segment(tree, anchor, w2.length, key, prep)
                elif layout.checkpointed:
                    stored = self._attach_checkpointed(tree, anchor, w2.length, key, prep)
                else:
                    stored = self._attach_snapshot(tree, anchor, w2.length, key, prep)
            finally:
                self._unpin(tree, [anchor])
            if not stored:
                tree.stats.rejected += 1
            elif self.disk is not None and layout.sliceable and w2.length < n:
                # Behind the RAM tier: the disk writes what it lacks of the path, which
                # may be more than this insert added (the disk drops files on its own).
                path = [(nd.start, nd.depth, nd.segment) for nd in walk(tree.root, key).nodes]
                self.disk.put(model, key, path, layers.layout_json(layout))
            return stored

    def _anchor(self, tree: _Tree, w: Walk, n: int, prep: planning.Prepared) -> Node:
        """The node the new sequence ends at or hangs from, splitting an edge if needed."""
        end = w.nodes[-1] if w.nodes else tree.root
        if not w.partial or (tree.layout.sliceable and w.length == n):
            return end
        k = w.length - end.start
        tree.version += 1
        if not tree.layout.segmented:
            return split(end, k)
        halves = prep.halves if prep.split_of is end.segment and prep.split_at == k else None
        if halves is None:  # another insert split this edge meanwhile
            halves = layers.cut_segment(end.segment, 0, k), layers.cut_segment(end.segment, k)
        head = split(end, k)
        head.segment, end.segment = halves
        head.segment_nbytes = self.measure(halves[0])
        end.segment_nbytes = self.measure(halves[1])
        return head

    def _attach_segment(
        self, tree: _Tree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        if m * TOKEN == len(key):  # already on a stored path; only recency changes
            if parent.terminal and parent.depth == m:
                self._lru.touch(parent, tree)
            return True
        seg = prep.segment
        if m > prep.start:  # another insert stored part of it meanwhile
            seg = layers.cut_segment(seg, m - prep.start)
        need = self.measure(seg)
        extends = parent.terminal  # the stored sequence becomes a prefix of this one
        if extends:
            self._unmark(tree, parent)
        if not self._make_room(need, 0 if extends else 1):
            if extends:
                self._mark(tree, parent)
            return False
        child = add_child(parent, key[m * TOKEN :])
        tree.version += 1
        child.segment, child.segment_nbytes = seg, need
        self._add_bytes(tree, need)
        self._mark(tree, child)
        return True

    def _attach_checkpointed(
        self, tree: _Tree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        """As `_attach_segment`, and the new end holds the checkpoint (an end already on
        the tree gets it, if it has none)."""
        if m * TOKEN == len(key):
            if parent.checkpoint is None:
                if not self._make_room(prep.checkpoint_nbytes, 0):
                    return False
                parent.checkpoint = prep.checkpoint
                parent.checkpoint_nbytes = prep.checkpoint_nbytes
                self._add_bytes(tree, prep.checkpoint_nbytes)
            parent.checkpoint_used = self._tick()
            if parent.terminal:
                self._lru.touch(parent, tree)
            return True
        seg = prep.segment
        if m > prep.start:  # another insert stored part of it meanwhile
            seg = layers.cut_segment(seg, m - prep.start)
        seg_nbytes = self.measure(seg)
        extends = parent.terminal
        if extends:
            self._unmark(tree, parent)
        if not self._make_room(seg_nbytes + prep.checkpoint_nbytes, 0 if extends else 1):
            if extends:
                self._mark(tree, parent)
            return False
        child = add_child(parent, key[m * TOKEN :])
        tree.version += 1
        child.segment, child.segment_nbytes = seg, seg_nbytes
        child.checkpoint, child.checkpoint_nbytes = prep.checkpoint, prep.checkpoint_nbytes
        child.checkpoint_used = self._tick()
        self._add_bytes(tree, seg_nbytes + prep.checkpoint_nbytes)
        self._mark(tree, child)
        return True

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _drop_checkpoint(self) -> bool:
        """Free the checkpoint `checkpoints.first_to_drop` picks over all trees."""
        found = [(n, tree) for tree in self._trees.values() if tree.layout.checkpointed
                 for n in iter_nodes(tree.root)]  # fmt: skip
        node = checkpoints.first_to_drop(n for n, _ in found)
        if node is None:
            return False
        tree = next(t for n, t in found if n is node)
        self._add_bytes(tree, -node.checkpoint_nbytes)
        node.checkpoint, node.checkpoint_nbytes = None, 0
        tree.version += 1
        return True

    def _attach_snapshot(
        self, tree: _Tree, parent: Node, m: int, key: bytes, prep: planning.Prepared
    ) -> bool:
        ends_here = m * TOKEN == len(key)
        replaces = ends_here and parent.terminal
        old = parent.entry_nbytes if replaces else 0
        if not self._make_room(max(0, prep.entry_nbytes - old), 0 if replaces else 1):
            return False
        node = parent if ends_here else add_child(parent, key[m * TOKEN :])
        tree.version += 1
        node.entry, node.entry_nbytes = prep.entry, prep.entry_nbytes
        node.entry_trimmable = prep.entry_trimmable
        self._add_bytes(tree, prep.entry_nbytes - old)
        if replaces:
            self._lru.touch(node, tree)
        else:
            self._mark(tree, node)
        return True

    # -------------------------------------------------------------- eviction

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> int:
        """Evict LRU sequences until at most `n_sequences` and `n_bytes` remain."""
        seqs = _NO_LIMIT if n_sequences is None else max(0, n_sequences)
        nb = _NO_LIMIT if n_bytes is None else max(0, n_bytes)
        evicted = 0
        with self._lock:
            while len(self._lru) > seqs or self._nbytes > nb:
                excess = 0 if len(self._lru) > seqs else self._nbytes - nb
                if not self._evict_one(excess):
                    break
                evicted += 1
        return evicted

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
                    self._drop(tree, node)
                if not tree.root.children:
                    del self._trees[key]

    def _make_room(self, need_bytes: int, need_sequences: int) -> bool:
        if need_bytes > self.max_bytes or need_sequences > self.max_sequences:
            return False
        while True:
            excess = self._nbytes + need_bytes - self.max_bytes
            if len(self._lru) + need_sequences > self.max_sequences:
                excess = 0  # a whole sequence has to go
            elif excess <= 0:
                return True
            if not self._evict_one(excess) and not (excess > 0 and self._drop_checkpoint()):
                return False

    def _evict_one(self, excess: int = 0) -> bool:
        """Make room from the LRU sequence: `excess` bytes off its end if > 0 and it can."""
        found = self._lru.victim(lambda node: node.pins == 0)
        if found is None:
            return False
        node, tree = found
        if excess > 0 and self._shorten(tree, node, excess):
            tree.stats.shortened += 1
            return True
        self._drop(tree, node)
        tree.stats.evictions += 1
        return True

    def _shorten(self, tree: _Tree, node: Node, excess: int) -> bool:
        """Cut at least `excess` bytes off the end of the sequence ending at `node`.

        Only what no other sequence and no running operation uses is cut: the
        chain of single-child nodes above the leaf. Whole nodes go without a
        copy; cutting into one copies what it keeps, and when that copy would
        exceed `SHORTEN_COPY` times the bytes freed, the whole node goes instead.
        False, with nothing changed, when the sequence has to go whole.
        """
        if not tree.layout.sliceable or node.children:
            return False
        owned = [node]  # deepest first
        up = node.parent
        while up is not None and up.parent is not None and _owned_by_one(up):
            owned.append(up)
            up = up.parent
        tokens = sum(n.size for n in owned)
        per_token = sum(n.segment_nbytes for n in owned) // tokens
        if not per_token:
            return False
        cut = -(-excess // per_token)
        if cut >= tokens:
            return False
        gone, part = 0, cut  # nodes dropped whole, from the bottom; tokens to cut into the next
        while part >= owned[gone].size:
            part -= owned[gone].size
            gone += 1
        end = owned[gone]
        if part and (end.size - part) > self._shorten_copy * cut:
            if gone + 1 == len(owned):
                return False
            gone, part = gone + 1, 0
            end = owned[gone]
        for dropped in owned[:gone]:
            detach(dropped)
            self._add_bytes(tree, -dropped.segment_nbytes)
        if part:
            keep = end.size - part
            end.segment = layers.cut_segment(end.segment, 0, keep)
            kept = self.measure(end.segment)
            self._add_bytes(tree, kept - end.segment_nbytes)
            end.segment_nbytes = kept
            end.edge = end.edge[: keep * TOKEN]
            end.depth -= part
        if end is not node:
            node.terminal, end.terminal = False, True
            self._lru.replace(node, end)
        tree.version += 1
        return True

    # ------------------------------------------------------- node bookkeeping

    def _mark(self, tree: _Tree, node: Node) -> None:
        node.terminal = True
        tree.stats.sequences += 1
        self._lru.touch(node, tree)

    def _unmark(self, tree: _Tree, node: Node) -> None:
        node.terminal = False
        tree.stats.sequences -= 1
        self._lru.discard(node)

    def _drop(self, tree: _Tree, node: Node) -> None:
        """Remove the sequence ending at `node`, and the nodes only it needed."""
        self._unmark(tree, node)
        self._add_bytes(tree, -node.entry_nbytes)
        node.entry, node.entry_nbytes = None, 0
        self._prune(tree, node)

    def _prune(self, tree: _Tree, node: Node) -> None:
        while node.parent is not None and not node.children and not node.terminal and not node.pins:
            parent = node.parent
            detach(node)
            tree.version += 1
            self._add_bytes(tree, -(node.segment_nbytes + node.checkpoint_nbytes))
            node = parent

    def _add_bytes(self, tree: _Tree, delta: int) -> None:
        tree.stats.bytes += delta
        self._nbytes += delta

    @staticmethod
    def _pin(nodes: list[Node]) -> None:
        for node in nodes:
            node.pins += 1

    def _unpin(self, tree: _Tree, nodes: list[Node]) -> None:
        for node in nodes:
            node.pins -= 1
        for node in reversed(nodes):
            self._prune(tree, node)


def _owned_by_one(node: Node) -> bool:
    """Whether only the sequence below uses `node`: no branch, no end, no pin."""
    return not node.terminal and not node.pins and len(node.children) == 1
