"""The cache's books: the bytes it holds, its clock, which nodes end a cached sequence and
which are pinned, kept in step with every change to its trees.

Invariants (each holds whenever the cache's lock is free):
- `nbytes` is the sum of every tree's `stats.bytes`, and each tree's is the sum of what
  its nodes hold (each one's `held.nbytes`, see `held`).
- A node is in the LRU order exactly while it is `terminal`, and each tree's
  `stats.sequences` counts its terminal nodes.
- A node with `pins > 0` stays in its tree; an unpinned node that holds nothing for a
  sequence (no child, not terminal) is removed when its last pin goes (`prune`).
- The clock only moves forward: `used` orders window KV and checkpoints by use.
"""

from __future__ import annotations

import time

from .eviction import LRUOrder
from .radix import Node, detach
from .tree import ModelTree


class Ledger:
    """The byte count, the clock and the node bookkeeping of one `PromptCache`.

    Given the cache's LRU order (the cache owns it; eviction reads it too). Every method
    expects the cache's lock held: the books and the trees change together.
    """

    def __init__(self, lru: LRUOrder[Node, ModelTree]) -> None:
        self._lru = lru
        self.nbytes = 0  # read by anyone; written only here
        self._clock = 0  # orders window KV and checkpoints by use

    def tick(self) -> int:
        """The next time on the clock."""
        self._clock += 1
        return self._clock

    def touch(self, node: Node, tree: ModelTree) -> None:
        """A cached sequence just used: last in the LRU order, and its time on the clock that
        window KV and checkpoints are ordered by too."""
        node.used, node.seen = self.tick(), time.time()
        self._lru.touch(node, tree)

    def mark(self, tree: ModelTree, node: Node) -> None:
        """A cached sequence now ends at `node`."""
        node.terminal = True
        tree.stats.sequences += 1
        self.touch(node, tree)

    def unmark(self, tree: ModelTree, node: Node) -> None:
        """No cached sequence ends at `node` any more (its nodes stay)."""
        node.terminal = False
        tree.stats.sequences -= 1
        self._lru.discard(node)

    def move_end(self, old: Node, new: Node) -> None:
        """The sequence ending at `old` now ends at `new`, an ancestor (its end was cut),
        keeping its place in the LRU order and its time."""
        old.terminal, new.terminal = False, True
        new.used = old.used
        self._lru.replace(old, new)

    def drop(self, tree: ModelTree, node: Node) -> None:
        """Remove the sequence ending at `node`, and the nodes only it needed."""
        self.unmark(tree, node)
        if node.held is not None and node.held.alone:
            self.add_bytes(tree, -node.held.nbytes)
            node.held = None
        self.prune(tree, node)

    def prune(self, tree: ModelTree, node: Node) -> None:
        """Remove `node` and the ancestors above it that no sequence, child or pin holds."""
        while node.parent is not None and not node.children and not node.terminal and not node.pins:
            parent = node.parent
            detach(node)
            tree.version += 1
            self.add_bytes(tree, -(node.held.nbytes if node.held is not None else 0))
            node = parent

    def add_bytes(self, tree: ModelTree, delta: int) -> None:
        tree.stats.bytes += delta
        self.nbytes += delta

    @staticmethod
    def pin(nodes: list[Node]) -> None:
        """Keep `nodes` in their tree until `unpin`: a running fetch or insert uses them."""
        for node in nodes:
            node.pins += 1

    def unpin(self, tree: ModelTree, nodes: list[Node]) -> None:
        """Undo `pin`, pruning what nothing holds any more (deepest first)."""
        for node in nodes:
            node.pins -= 1
        for node in reversed(nodes):
            self.prune(tree, node)
