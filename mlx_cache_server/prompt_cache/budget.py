"""Keeping the cache within its limits: which sequence goes, when the end of one is cut
instead, and when a hybrid model's window KV or checkpoint goes first.

Invariants: after `make_room` returns True, the cache holds at most `max_sequences`
sequences and `max_bytes` bytes with the room asked for added; nothing pinned is
removed; a cut end leaves the sequence's place in the LRU order as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from . import checkpoints, layers
from .eviction import LRUOrder
from .ledger import Ledger
from .radix import TOKEN, Node, detach, iter_nodes
from .tree import ModelTree

SHORTEN_COPY = 4  # most bytes copied per byte freed when cutting a sequence's end
NO_LIMIT = 1 << 62


class Budget:
    """A `PromptCache`'s limits and what it evicts to keep them.

    Given the cache's trees (where a hybrid model's window KV and checkpoints are looked
    for), its LRU order (which sequence goes first), its ledger (the byte count, and what
    removing a sequence takes) and its `measure` (of what is kept of a cut segment). Every
    method expects the cache's lock held.
    """

    def __init__(
        self,
        max_sequences: int,
        max_bytes: int,
        trees: dict[Hashable, ModelTree],
        lru: LRUOrder[Node, ModelTree],
        ledger: Ledger,
        measure: Callable[[Any], int],
    ) -> None:
        self.max_sequences = max_sequences
        self.max_bytes = max_bytes
        self.shorten_copy = SHORTEN_COPY
        self._trees = trees
        self._lru = lru
        self._ledger = ledger
        self._measure = measure

    def trim(self, n_sequences: int, n_bytes: int) -> int:
        """Evict LRU sequences until at most `n_sequences` and `n_bytes` remain; how many
        were evicted (or cut at their end)."""
        evicted = 0
        while len(self._lru) > n_sequences or self._ledger.nbytes > n_bytes:
            excess = 0 if len(self._lru) > n_sequences else self._ledger.nbytes - n_bytes
            if not self._evict_one(excess):
                break
            evicted += 1
        return evicted

    def make_room(self, need_bytes: int, need_sequences: int) -> bool:
        """Evict until both limits hold with `need_*` more; False (having evicted) if they
        cannot. When only bytes are short, what was used least recently goes first: the LRU
        sequence, or a hybrid model's window KV or checkpoint that no sequence's end needs."""
        if need_bytes > self.max_bytes or need_sequences > self.max_sequences:
            return False
        while True:
            excess = self._ledger.nbytes + need_bytes - self.max_bytes
            if len(self._lru) + need_sequences > self.max_sequences:
                if not self._evict_one(0):  # a whole sequence has to go
                    return False
                continue
            if excess <= 0:
                return True
            victim = self._lru.victim(lambda node: node.pins == 0)
            loose = self._loosest()
            if loose is not None and (victim is None or loose[0][0].used < victim[0].used):
                self._drop_loose(*loose)
            elif victim is None or not self._evict_one(excess, victim):
                return False

    def _evict_one(self, excess: int = 0, found: tuple[Node, ModelTree] | None = None) -> bool:
        """Make room from the LRU sequence (or `found`): `excess` bytes off its end if > 0
        and it can."""
        found = found or self._lru.victim(lambda node: node.pins == 0)
        if found is None:
            return False
        node, tree = found
        if excess > 0 and self._shorten(tree, node, excess):
            tree.stats.shortened += 1
            return True
        self._ledger.drop(tree, node)
        tree.stats.evictions += 1
        return True

    def _shorten(self, tree: ModelTree, node: Node, excess: int) -> bool:
        """Cut at least `excess` bytes off the end of the sequence ending at `node`.

        Only what no other sequence and no running operation uses is cut: the
        chain of single-child nodes above the leaf. Whole nodes go without a
        copy; cutting into one copies what it keeps, and when that copy would
        exceed `shorten_copy` (`SHORTEN_COPY`) times the bytes freed, the whole node goes instead.
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
        per_token = sum(n.held.segment_nbytes for n in owned) // tokens
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
        if part and (end.size - part) > self.shorten_copy * cut:
            if gone + 1 == len(owned):
                return False
            gone, part = gone + 1, 0
            end = owned[gone]
        for dropped in owned[:gone]:
            detach(dropped)
            self._ledger.add_bytes(tree, -dropped.held.segment_nbytes)
        if part:
            keep = end.size - part
            held = end.held
            held.segment = layers.cut_segment(held.segment, 0, keep)
            kept = self._measure(held.segment)
            self._ledger.add_bytes(tree, kept - held.segment_nbytes)
            held.segment_nbytes = kept
            end.edge = end.edge[: keep * TOKEN]
            end.depth -= part
        if end is not node:
            self._ledger.move_end(node, end)
        tree.version += 1
        return True

    def _loosest(self) -> tuple[tuple[Node, str, int], ModelTree] | None:
        """What `checkpoints.first_to_drop` picks over all trees, with its tree."""
        found = []
        for tree in self._trees.values():
            if tree.layout.checkpointed:
                pick = checkpoints.first_to_drop(iter_nodes(tree.root), tree.layout.span)
                if pick is not None:
                    found.append((pick, tree))
        return min(found, key=lambda f: f[0][0].used, default=None)

    def _drop_loose(self, pick: tuple[Node, str, int], tree: ModelTree) -> None:
        """Free a checkpoint, or the oldest `k` tokens of a node's window KV."""
        node, what, k = pick
        held = node.held
        if what == "checkpoint":
            self._ledger.add_bytes(tree, -held.checkpoint_nbytes)
            held.checkpoint, held.checkpoint_nbytes = None, 0
        else:
            held.window_held -= k
            held.window = layers.cut_segment(held.window, k) if held.window_held else None
            nbytes = self._measure(held.window) if held.window is not None else 0
            self._ledger.add_bytes(tree, nbytes - held.window_nbytes)
            held.window_nbytes = nbytes
        tree.version += 1


def _owned_by_one(node: Node) -> bool:
    """Whether only the sequence below uses `node`: no branch, no end, no pin."""
    return not node.terminal and not node.pins and len(node.children) == 1
